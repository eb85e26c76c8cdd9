"""Pinned host <-> device copy bandwidth by size: H2D alone, D2H alone, and both at once on two streams.

    python -m bench.gpu.pinned_bandwidth [--sizes-mib 1 4 16 64 256 1024] [--repeats 10] [--seconds 90]

Host memory comes from the swap host pool (exact-size blocks pinned with cuMemHostRegister), the memory the
swap runtime copies through. Each figure is the median of the repeats, timed with CUDA events.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from bench.gpu import common


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms / 1e3) / 1e9


def measure(size: int, repeats: int) -> dict[str, float]:
    import torch

    from swap.runtime.machine.host_pool import HostPool

    pool = HostPool(pinned=True, block_size=2 * size)
    try:
        src_h, dst_h = pool.alloc(size).view, pool.alloc(size).view
        src_h.fill_(1)
        src_d = torch.ones(size, dtype=torch.uint8, device="cuda")
        dst_d = torch.empty(size, dtype=torch.uint8, device="cuda")
        h2d_s, d2h_s = torch.cuda.Stream(), torch.cuda.Stream()

        def timed(stream: Any, fn: Any) -> tuple[Any, Any]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                fn()
                end.record(stream)
            return start, end

        out: dict[str, list[float]] = {"h2d": [], "d2h": [], "both_h2d": [], "both_d2h": [], "both_total": []}
        for _ in range(repeats + 1):  # the first round warms up
            torch.cuda.synchronize()
            a = timed(h2d_s, lambda: dst_d.copy_(src_h, non_blocking=True))
            torch.cuda.synchronize()
            b = timed(d2h_s, lambda: dst_h.copy_(src_d, non_blocking=True))
            torch.cuda.synchronize()
            c = timed(h2d_s, lambda: dst_d.copy_(src_h, non_blocking=True))
            d = timed(d2h_s, lambda: dst_h.copy_(src_d, non_blocking=True))
            torch.cuda.synchronize()
            out["h2d"].append(gbps(size, a[0].elapsed_time(a[1])))
            out["d2h"].append(gbps(size, b[0].elapsed_time(b[1])))
            out["both_h2d"].append(gbps(size, c[0].elapsed_time(c[1])))
            out["both_d2h"].append(gbps(size, d[0].elapsed_time(d[1])))
            span = max(c[0].elapsed_time(c[1]), d[0].elapsed_time(d[1]), c[0].elapsed_time(d[1]))
            out["both_total"].append(gbps(2 * size, span))
        assert bool((dst_d[:16] == 1).all()) and bool((dst_h[:16] == 1).all())
        return {k: common.percentile(v[1:], 50) for k, v in out.items()}
    finally:
        pool.close()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seconds", type=float, default=90)
    args = p.parse_args(argv)
    common.require_gpu()
    env = common.environment()
    box = common.TimeBox(args.seconds)
    results: dict[str, dict[str, float]] = {}
    rows: list[list[Any]] = []
    header = ["size", "H2D GB/s", "D2H GB/s", "both: H2D", "both: D2H", "both: total"]
    for mib in args.sizes_mib:
        if box.expired():
            print(f"pinned_bandwidth: time box reached before {mib} MiB", flush=True)
            break
        results[str(mib)] = measure(mib * common.MiB, args.repeats)
        rows = [[f"{m} MiB", *(r[k] for k in ("h2d", "d2h", "both_h2d", "both_d2h", "both_total"))]
                for m, r in ((int(k), v) for k, v in results.items())]  # fmt: skip
        common.write("pinned_bandwidth", "Pinned host <-> device bandwidth", {"results_GBps": results},
                     common.table(header, rows), env)  # fmt: skip
        print(f"pinned_bandwidth: {mib} MiB: {results[str(mib)]}", flush=True)
    d = common.write("pinned_bandwidth", "Pinned host <-> device bandwidth", {"results_GBps": results},
                     common.table(header, rows), env, figure=plot(results))  # fmt: skip
    print(f"pinned_bandwidth: wrote {d}")
    return 0


def plot(results: dict[str, dict[str, float]]) -> Any:
    from bench.plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = sorted(results, key=int)
    for key, label in (("h2d", "H2D alone"), ("d2h", "D2H alone"), ("both_h2d", "H2D with D2H"),
                       ("both_d2h", "D2H with H2D"), ("both_total", "both, total")):  # fmt: skip
        ax.plot([int(s) for s in sizes], [results[s][key] for s in sizes], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("copy size (MiB)")
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


if __name__ == "__main__":
    sys.exit(main())
