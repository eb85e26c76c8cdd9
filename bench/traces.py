"""Allocation traces of the built-in models' training steps, captured without memory; and imported from
PyTorch snapshots.

    python -m bench.traces capture --model resnet50 --batch 256 --steps 3 --out resnet50_b256.npz
    python -m bench.traces capture --model resnet50 --batch 1440 --steps 3 --swap-budget 16GiB --out r50_swap.npz
    python -m bench.traces import SNAPSHOT.pickle --out mine.npz
    python -m bench.traces info FILE

Capture itself is the library's (``swap.capture``: full training steps on the meta device, any model;
Note [Trace file format] there); this module names the built-in workloads (``swap.forecast.zoo.ZOO``), caches their
traces under build/trace-cache, and imports traces from memory snapshots.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Optional

from swap.capture import ALLOC, FORMAT_VERSION, FREE, ITER_BEGIN, ITER_END, Trace, TraceBuilder, summary
from swap.capture import capture as capture_step
from swap.forecast.from_trace import swapped
from swap.forecast.zoo import ZOO

# name -> (builder, default input size), as before the zoo.
MODELS = {name: (w.build, w.size) for name, w in ZOO.items()}


def capture(model: str, batch: int, steps: int = 3, size: Optional[int] = None, progress: bool = True) -> Trace:
    """Records ``steps`` training steps of the built-in ``model`` (a key of ``MODELS``) at ``batch`` on the
    meta device, with its optimizer (SGD with momentum) and dtype, mirroring CUDA's kernels."""
    if model not in ZOO:
        raise ValueError(f"unknown model {model!r}: choose one of {', '.join(ZOO)}")
    w = ZOO[model]
    size = size or w.size
    trace = capture_step(w.model_fn(), w.batch_fn(size), batch, optimizer=w.optimizer, steps=steps, dtype=w.dtype,
                         name=model, progress=progress)  # fmt: skip
    trace.meta["size"] = size
    return trace


def import_snapshot(path: str | Path, device: int = 0) -> Trace:
    """A trace from a PyTorch memory snapshot pickle (``torch.cuda.memory._dump_snapshot``), from its
    ``device_traces`` (``alloc`` / ``free_completed`` actions; record history with enough entries)."""
    with open(path, "rb") as f:
        snap = pickle.load(f)
    if not isinstance(snap, dict) or "device_traces" not in snap:
        raise ValueError(f"{path} is not a PyTorch memory snapshot (no 'device_traces')")
    traces = snap["device_traces"]
    if device >= len(traces) or not traces[device]:
        raise ValueError(f"{path}: no trace entries for device {device}; record with "
                         "torch.cuda.memory._record_memory_history(max_entries=...) before dumping")  # fmt: skip
    b = TraceBuilder()
    live: dict[int, tuple[int, int]] = {}  # addr -> (id, size)
    next_id = 0
    # Blocks alive when the trace starts were allocated before it: they appear as frees of unknown
    # allocations. Allocate them up front so the replay holds them from the beginning.
    first_seen: dict[int, int] = {}
    for e in traces[device]:
        if e["action"] == "alloc":
            first_seen.setdefault(e["addr"], 1)
        elif e["action"] == "free_completed" and e["addr"] not in first_seen:
            first_seen[e["addr"]] = 0
    for addr, kind in first_seen.items():
        if kind == 0:
            size = next(e["size"] for e in traces[device] if e["addr"] == addr)
            live[addr] = (next_id, size)
            b.add(ALLOC, next_id, size)
            next_id += 1
    b.add(ITER_BEGIN, 0)
    for e in traces[device]:
        action, addr, size = e["action"], e["addr"], e["size"]
        if action == "alloc":
            live[addr] = (next_id, size)
            b.add(ALLOC, next_id, size, stream=e.get("stream", 0))
            next_id += 1
        elif action == "free_completed" and addr in live:
            ident, size = live.pop(addr)
            b.add(FREE, ident, size, stream=e.get("stream", 0))
    b.add(ITER_END, 0)
    return b.build({"format_version": FORMAT_VERSION, "source": "snapshot", "path": str(path), "steps": 1})


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.traces", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture", help="capture training steps on the meta device")
    c.add_argument("--model", required=True, choices=sorted(MODELS))
    c.add_argument("--batch", type=int, required=True)
    c.add_argument("--steps", type=int, default=3)
    c.add_argument("--size", type=int, default=None, help="image side, or sequence length for GPT")
    c.add_argument("--swap-budget", default=None, help="also apply the swap runtime's schedule for this budget")
    c.add_argument("--policy", default="window")
    c.add_argument("--out", required=True)
    i = sub.add_parser("import", help="import a PyTorch memory snapshot pickle")
    i.add_argument("snapshot")
    i.add_argument("--device", type=int, default=0)
    i.add_argument("--out", default=None)
    n = sub.add_parser("info", help="summarize a trace file")
    n.add_argument("trace")
    args = ap.parse_args(argv)
    if args.cmd == "capture":
        trace = capture(args.model, args.batch, args.steps, args.size)
        if args.swap_budget:
            import vmalloc

            trace = swapped(trace, vmalloc.parse_size(args.swap_budget), args.policy)
        trace.meta["command"] = "python -m bench.traces " + " ".join(sys.argv[1:] if argv is None else argv)
        print(f"wrote {trace.save(args.out)}: {summary(trace)}")
    elif args.cmd == "import":
        trace = import_snapshot(args.snapshot, args.device)
        out = args.out or str(Path(args.snapshot).with_suffix(".npz"))
        print(f"wrote {trace.save(out)}: {summary(trace)}")
    else:
        print(summary(Trace.load(args.trace)))
    return 0


CACHE = Path(__file__).resolve().parents[1] / "build" / "trace-cache"


def cached_capture(model: str, batch: int, steps: int, size: Optional[int] = None) -> Trace:
    """``capture``, kept under build/trace-cache (traces are regenerated on demand, never committed)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"{model}_b{batch}{'' if size is None else f'_n{size}'}_s{steps}.npz"
    if path.exists():
        try:
            cached = Trace.load(path)
            if cached.meta.get("format_version") == FORMAT_VERSION:
                return cached
        except (ValueError, OSError):
            pass
        # an older format (e.g. without operator events): capture again
    t0 = time.perf_counter()
    trace = capture(model, batch, steps, size, progress=False)
    # Written under a name of this process's, then renamed: a test worker running beside this one (make test runs
    # in parallel, Note [Tests in parallel] in the Makefile) never loads a half-written file.
    os.replace(trace.save(path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")), path)
    print(f"  captured {model} batch {batch} ({len(trace)} events) in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr, flush=True)  # fmt: skip
    return trace


if __name__ == "__main__":
    sys.exit(main())
