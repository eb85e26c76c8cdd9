"""Training traces replayed on the real PyTorch allocator (native and expandable_segments) and on vmalloc
as torch's allocator, with measured peaks; and the error of bench/torch_policy.py's models against them.

    python -m bench.gpu.allocator_replay [--traces resnet50:128 gpt2:8 ...] [--seconds 180]

Every allocation of the trace is a ``torch.empty`` of its size on the GPU, every free drops it. Each
allocator runs in its own process (``PYTORCH_CUDA_ALLOC_CONF`` and the allocator are process-wide). The
policy models replay the same trace on the CPU (swap.forecast.replay.replay); their error is (model - measured) /
measured peak reserved bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from bench.gpu import common

ALLOCATORS = {  # name -> PYTORCH_CUDA_ALLOC_CONF (None: vmalloc as torch's allocator)
    "native": "",
    "expandable": "expandable_segments:True",
    "vmalloc": None,
}
MODEL_OF = {"native": "pytorch_native", "expandable": "pytorch_expandable", "vmalloc": "vmalloc"}
DEFAULT_TRACES = ["resnet50:128", "resnet50:128:swap", "gpt2:8", "gpt2:8:swap", "unet:16:swap"]


def parse_trace_spec(spec: str) -> tuple[str, int, bool]:
    """"model:batch[:swap]" -> (model, batch, swapped)."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[1].isdigit() or (len(parts) == 3 and parts[2] != "swap"):
        raise ValueError(f"trace spec {spec!r}: use MODEL:BATCH or MODEL:BATCH:swap (e.g. resnet50:128:swap)")
    return parts[0], int(parts[1]), len(parts) == 3


def make_trace(spec: str) -> Any:
    from bench.traces import cached_capture
    from swap.capture import live_peak
    from swap.forecast.from_trace import swapped

    model, batch, swap = parse_trace_spec(spec)
    trace = cached_capture(model, batch, steps=3)
    if swap:  # the run the swap runtime would make under 60% of the unswapped peak
        trace = swapped(trace, int(0.6 * live_peak(trace)))
    return trace


def replay_on_gpu(trace_path: str, allocator: str) -> dict[str, Any]:
    """Child process: replays the trace with torch.empty under ``allocator``; returns measured peaks."""
    import time

    import numpy as np
    import torch

    from swap.capture import ALLOC, FREE, Trace

    if allocator == "vmalloc":
        import vmalloc

        torch.cuda.memory.change_current_allocator(vmalloc.allocator())
    trace = Trace.load(trace_path)
    ops, ids, sizes = trace.op.tolist(), trace.id.tolist(), trace.size.tolist()
    live: dict[int, Any] = {}
    t0 = time.perf_counter()
    oom = None
    if allocator != "vmalloc":
        torch.cuda.reset_peak_memory_stats()
    for k, (o, i, s) in enumerate(zip(ops, ids, sizes)):
        if o == ALLOC and s > 0:
            try:
                live[i] = torch.empty(s, dtype=torch.uint8, device="cuda")
            except torch.cuda.OutOfMemoryError:
                oom = k
                break
        elif o == FREE:
            live.pop(i, None)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if allocator == "vmalloc":
        import vmalloc

        s = vmalloc.stats(0)
        peak_res, peak_alloc = s["reserved_bytes.all.peak"], s["allocated_bytes.all.peak"]
    else:
        peak_res, peak_alloc = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
    n = int(np.sum(trace.op == ALLOC))
    return {"peak_reserved": peak_res, "peak_allocated": peak_alloc, "oom_at": oom, "us_per_alloc": 1e6 * seconds / n}


def run_child(trace_path: Path, allocator: str, timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    conf = ALLOCATORS[allocator]
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    cmd = [sys.executable, "-m", "bench.gpu.allocator_replay", "--child", str(trace_path), allocator]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10.0, timeout), env=env, cwd=common.ROOT)
    if r.returncode != 0:
        return {"error": r.stderr.strip()[-800:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def model_error(trace: Any, allocator: str, measured: int) -> Optional[float]:
    """(model's peak reserved - measured) / measured, for the policy model of ``allocator``."""
    from swap.forecast.replay.replay import measure

    predicted = measure(trace, MODEL_OF[allocator])["peak_reserved"]
    return (predicted - measured) / measured if measured else None


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", nargs="+", default=DEFAULT_TRACES, help="MODEL:BATCH[:swap] (bench.traces.MODELS)")
    p.add_argument("--allocators", nargs="+", default=list(ALLOCATORS), choices=list(ALLOCATORS))
    p.add_argument("--seconds", type=float, default=240)
    p.add_argument("--child", nargs=2, metavar=("TRACE", "ALLOCATOR"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(replay_on_gpu(args.child[0], args.child[1])))
        return 0
    for spec in args.traces:
        parse_trace_spec(spec)  # bad specs fail before any work
    common.require_gpu()
    env = common.environment()
    box = common.TimeBox(args.seconds)
    results: dict[str, dict[str, Any]] = {}
    rows: list[list[Any]] = []
    header = ["trace", "requested GiB", "allocator", "measured reserved GiB", "allocated GiB", "model GiB",
              "model error", "µs/alloc"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.traces:
            if box.expired():
                print(f"allocator_replay: time box reached before {spec}", flush=True)
                break
            from swap.capture import live_peak

            trace = make_trace(spec)
            path = Path(tmp) / (common.slug(spec) + ".npz")
            trace.save(path)
            results[spec] = {"requested_peak": live_peak(trace)}
            for alloc in args.allocators:
                r = run_child(path, alloc, box.left())
                if "error" not in r and r["oom_at"] is None:
                    r["model_error"] = model_error(trace, alloc, r["peak_reserved"])
                    r["model_peak_reserved"] = (1 + r["model_error"]) * r["peak_reserved"]
                results[spec][alloc] = r
                gib = 2**30
                rows.append([spec, results[spec]["requested_peak"] / gib, alloc,
                             r.get("peak_reserved", float("nan")) / gib, r.get("peak_allocated", float("nan")) / gib,
                             r.get("model_peak_reserved", float("nan")) / gib, r.get("model_error", r.get("error", "")),
                             r.get("us_per_alloc", float("nan"))])  # fmt: skip
                print(f"allocator_replay: {spec} on {alloc}: {r}", flush=True)
                common.write("allocator_replay", "Training traces on the real allocators", {"results": results},
                             common.table(header, rows), env)  # fmt: skip
    d = common.write("allocator_replay", "Training traces on the real allocators", {"results": results},
                     common.table(header, rows), env, figure=plot(results))  # fmt: skip
    print(f"allocator_replay: wrote {d}")
    return 0


def plot(results: dict[str, dict[str, Any]]) -> Any:
    from bench.plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    specs = list(results)
    width = 0.8 / (len(ALLOCATORS) + 1)
    for j, alloc in enumerate(["requested", *ALLOCATORS]):
        ys = []
        for s in specs:
            r = results[s]
            peak = r["requested_peak"] if alloc == "requested" else r.get(alloc, {}).get("peak_reserved", 0)
            ys.append(peak / 2**30)
        ax.bar([i + j * width for i in range(len(specs))], ys, width, label=alloc)
    ax.set_xticks([i + 0.4 for i in range(len(specs))], specs, rotation=20, fontsize=7)
    ax.set_ylabel("peak GiB")
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    sys.exit(main())
