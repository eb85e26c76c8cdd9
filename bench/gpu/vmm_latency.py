"""Latency of the CUDA driver's VMM calls vmalloc is built on, per chunk size (cuda-python).

    python -m bench.gpu.vmm_latency [--sizes-mib 2 4 20 64] [--repeats 200] [--seconds 60]

Each repeat creates a chunk (cuMemCreate), maps it into a reserved range (cuMemMap), makes it accessible
(cuMemSetAccess), then unmaps (cuMemUnmap) and releases it (cuMemRelease); each call is timed alone. Times
include cuda-python's call overhead (about a microsecond), which the medians of the larger calls dwarf.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Optional

from bench.gpu import common

CALLS = ("cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease")


def summarize(samples_ns: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    """Median, p90 and count of each call's samples, in microseconds."""
    return {
        call: {"median_us": common.percentile(v, 50) / 1e3, "p90_us": common.percentile(v, 90) / 1e3, "n": len(v)}
        for call, v in samples_ns.items()
        if v
    }


def measure(size: int, repeats: int, box: common.TimeBox, device: int = 0) -> dict[str, list[int]]:
    from cuda.bindings import driver as d

    def ok(r: Any, what: str) -> Any:
        err, *rest = r if isinstance(r, tuple) else (r,)
        if int(err) != 0:
            raise RuntimeError(f"{what}: {err!r}")
        return rest[0] if len(rest) == 1 else rest

    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    minimum = d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    gran = ok(d.cuMemGetAllocationGranularity(prop, minimum), "cuMemGetAllocationGranularity")
    if size % int(gran):
        raise ValueError(f"{size} bytes is not a multiple of the granularity {gran}")
    access = d.CUmemAccessDesc()
    access.location = prop.location
    access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    va = ok(d.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve")
    samples: dict[str, list[int]] = {c: [] for c in CALLS}
    clock = time.perf_counter_ns
    try:
        for _ in range(repeats):
            if box.expired():
                break
            t0 = clock()
            handle = ok(d.cuMemCreate(size, prop, 0), "cuMemCreate")
            t1 = clock()
            ok(d.cuMemMap(va, size, 0, handle, 0), "cuMemMap")
            t2 = clock()
            ok(d.cuMemSetAccess(va, size, [access], 1), "cuMemSetAccess")
            t3 = clock()
            ok(d.cuMemUnmap(va, size), "cuMemUnmap")
            t4 = clock()
            ok(d.cuMemRelease(handle), "cuMemRelease")
            t5 = clock()
            for call, dt in zip(CALLS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                samples[call].append(dt)
    finally:
        ok(d.cuMemAddressFree(va, size), "cuMemAddressFree")
    return samples


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[2, 4, 20, 64])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--seconds", type=float, default=60, help="time box for the whole benchmark")
    args = p.parse_args(argv)
    common.require_gpu()
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")  # the primary context, current in this thread
    env = common.environment()
    box = common.TimeBox(args.seconds)
    results: dict[str, Any] = {}
    rows = []
    for mib in args.sizes_mib:
        samples = measure(mib * common.MiB, args.repeats, box)
        results[str(mib)] = summarize(samples)
        for call, s in results[str(mib)].items():
            rows.append([f"{mib} MiB", call, s["median_us"], s["p90_us"], s["n"]])
        common.write("vmm_latency", "CUDA VMM call latency by chunk size", {"results_us": results},
                     common.table(["chunk", "call", "median µs", "p90 µs", "n"], rows), env)  # fmt: skip
        print(f"vmm_latency: {mib} MiB done", flush=True)
    fig = plot(results)
    probe = offset_probe()
    print(f"vmm_latency: cuMemMap at an offset into a larger allocation: {probe}", flush=True)
    notes = [f"cuMemMap at a non-zero offset into a two-chunk allocation (Note [Probing map offsets]): {probe}"]
    d = common.write("vmm_latency", "CUDA VMM call latency by chunk size",
                     {"results_us": results, "maps_at_offsets": probe},
                     common.table(["chunk", "call", "median µs", "p90 µs", "n"], rows), env, figure=fig,
                     notes=notes)  # fmt: skip
    print(f"vmm_latency: wrote {d}")
    return 0


def offset_probe() -> Any:
    """What the cuda backend's probe says of ``cuMemMap`` at an offset (cuda.h documents the offset and says it
    "currently must be zero"): True, False, or the error that kept the probe from running."""
    try:
        import vmalloc

        return vmalloc.Arena(capacity=64 * common.MiB, backend="cuda").maps_at_offsets
    except Exception as e:  # noqa: BLE001 - recorded, not raised: the latencies above are the result
        return f"not probed: {type(e).__name__}: {e}"


def plot(results: dict[str, dict[str, dict[str, float]]]) -> Any:
    from bench.plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = sorted(results, key=int)
    for call in CALLS:
        ys = [results[s][call]["median_us"] if call in results[s] else float("nan") for s in sizes]
        ax.plot([int(s) for s in sizes], ys, marker="o", label=call)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("chunk size (MiB)")
    ax.set_ylabel("median latency (µs)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


if __name__ == "__main__":
    sys.exit(main())
