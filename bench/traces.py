"""Allocation traces of real training steps, captured without memory; and imported from PyTorch snapshots.

    python -m bench.traces capture --model resnet50 --batch 256 --steps 3 --out resnet50_b256.npz
    python -m bench.traces capture --model resnet50 --batch 1440 --steps 3 --swap-budget 16GiB --out r50_swap.npz
    python -m bench.traces import SNAPSHOT.pickle --out mine.npz
    python -m bench.traces info FILE

Capture runs full training steps (forward, backward, optimizer) on the *meta* device, so paper-scale
batches need no memory: every new storage an operator returns is an allocation, and the storage's Python
object dying (PyTorch keeps exactly one per storage) is its free. The saved-tensor hooks mark each
activation's saves and uses, and the FLOPs and bytes of the operators between them (for the swap
simulator's cost model).

Note [Trace file format]
A trace is one ``.npz`` (numpy, compressed) with parallel arrays, one entry per event:

- ``op`` (uint8): 0 alloc, 1 free, 2 save (an activation is saved for backward), 3 use (backward reads
  it), 4 iteration begin, 5 iteration end, 6 unref (the forward itself no longer holds the activation: were
  autograd not keeping it, it would be freed here).
- ``id`` (int64): the allocation (alloc/free/unref; for save/use the activation's allocation), or the
  iteration number (4/5).
- ``size`` (int64): bytes (alloc/free/save/use).
- ``tag`` (uint8): what the allocation is (``TAGS``), on alloc and free.
- ``stream`` (int64): the stream (0 for captured traces).
- ``flops``, ``bytes`` (float64): on save/use events, the FLOPs and bytes moved by the operators since the
  previous save/use event (the compute of the step that ends there); on iteration end, those since the
  last save/use (the end of backward and the optimizer step).

and ``meta``, a JSON string: format version, model, batch, input size, dtype, steps, the command.
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from bench import models
from swap.grad_accumulation import EngineAccumulation

ALLOC, FREE, SAVE, USE, ITER_BEGIN, ITER_END, UNREF = range(7)
TAGS = ("temporary", "activation", "weight", "grad", "optimizer_state", "input")
TAG = {name: i for i, name in enumerate(TAGS)}
FORMAT_VERSION = 4  # 4: gradient sums recorded in place (swap.grad_accumulation)

MODELS = {
    "resnet50": (models.resnet50, 224),
    "densenet121": (models.densenet121, 224),
    "unet": (lambda: models.unet(depth=4, width=64), 256),
    "gpt2": (models.gpt2, 1024),
    "gpt2-bf16": (models.gpt2, 1024),
    "gpt2-medium-bf16": (models.gpt2_medium, 1024),
}


@dataclass
class Trace:
    op: np.ndarray
    id: np.ndarray
    size: np.ndarray
    tag: np.ndarray
    stream: np.ndarray
    flops: np.ndarray
    bytes: np.ndarray
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.op)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        np.savez_compressed(
            path, op=self.op, id=self.id, size=self.size, tag=self.tag, stream=self.stream, flops=self.flops,
            bytes=self.bytes, meta=np.array(json.dumps(self.meta)),
        )  # fmt: skip
        return path if path.suffix == ".npz" else path.with_suffix(path.suffix + ".npz")

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"{path}: trace format {meta.get('format_version')} != {FORMAT_VERSION}")
            return cls(z["op"], z["id"], z["size"], z["tag"], z["stream"], z["flops"], z["bytes"], meta)

    def iterations(self) -> list[tuple[int, int]]:
        """(begin, end) event indices of each iteration."""
        begins = np.flatnonzero(self.op == ITER_BEGIN)
        ends = np.flatnonzero(self.op == ITER_END)
        return list(zip(begins.tolist(), ends.tolist()))

    def allocations(self) -> int:
        return int((self.op == ALLOC).sum())


class _Builder:
    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int, int, float, float]] = []  # op, id, size, stream, flops, bytes
        self.tags: dict[int, int] = {}

    def add(self, op: int, ident: int, size: int = 0, flops: float = 0.0, nbytes: float = 0.0) -> None:
        self.rows.append((op, ident, size, 0, flops, nbytes))

    def build(self, meta: dict) -> Trace:
        a = np.array(self.rows, dtype=np.float64).reshape(-1, 6)
        ops = a[:, 0].astype(np.uint8)
        ids = a[:, 1].astype(np.int64)
        tags = np.array(
            [self.tags.get(i, 0) if o in (ALLOC, FREE) else 0 for o, i in zip(ops.tolist(), ids.tolist())],
            dtype=np.uint8,
        )
        return Trace(ops, ids, a[:, 2].astype(np.int64), tags, a[:, 3].astype(np.int64), a[:, 4], a[:, 5], meta)


class _Recorder(TorchDispatchMode):
    """Every new storage an operator returns is an allocation; its Python object dying is the free."""

    def __init__(self, b: _Builder) -> None:
        super().__init__()
        self.b = b
        self.ids: dict[int, tuple[weakref.ref, int]] = {}  # id(storage object) -> (ref, allocation id)
        self.next_id = 0
        self.flops = 0.0
        self.moved = 0.0
        self.watch: dict[int, tuple[weakref.ref, int]] = {}  # allocation id -> (storage ref, aliases we hold)
        self.accumulation = EngineAccumulation()  # Note [In-place gradient accumulation under a dispatch mode]
        self.superseded: set[int] = set()  # storages whose allocation an in-place sum's result took over

    def alloc_id(self, st: torch.UntypedStorage, tag: Optional[int] = None) -> int:
        key = id(st)
        known = self.ids.get(key)
        if known is not None and known[0]() is st:
            return known[1]
        ident, n = self.next_id, st.nbytes()
        self.next_id += 1
        self.ids[key] = (weakref.ref(st, lambda _r, k=key, i=ident, n=n: self._freed(k, i, n)), ident)
        self.b.add(ALLOC, ident, n)
        if tag is not None:
            self.b.tags[ident] = tag
        return ident

    def _take_over(self, old: torch.UntypedStorage, new: torch.UntypedStorage) -> None:
        """``new`` continues ``old``'s allocation: no alloc is recorded for it, and no free for ``old``."""
        ident, key, n = self.ids[id(old)][1], id(new), new.nbytes()
        self.superseded.add(id(old))
        self.ids[key] = (weakref.ref(new, lambda _r: self._freed(key, ident, n)), ident)

    def _freed(self, key: int, ident: int, n: int) -> None:
        if key in self.superseded:
            self.superseded.discard(key)
            return
        self.ids.pop(key, None)
        self.watch.pop(ident, None)
        self.b.add(FREE, ident, n)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        summed_into = self.accumulation.in_place_operand(func, args)
        out = func(*args, **kwargs)
        if summed_into is not None:  # eager PyTorch writes this sum into the first operand's memory
            self._take_over(summed_into.untyped_storage(), out.untyped_storage())
        flop_fn = flop_registry.get(func._overloadpacket)
        if flop_fn is not None:
            self.flops += flop_fn(*args, **kwargs, out_val=out)
        view = getattr(func, "is_view", False)  # views move no data
        if not view:
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor):
                    self.moved += t.numel() * t.element_size()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                if not view:
                    self.moved += t.numel() * t.element_size()
                self.alloc_id(t.untyped_storage())
        self._check_unrefs()
        return out

    def _check_unrefs(self) -> None:
        """Activations that only our aliases (i.e. autograd) still hold: the forward dropped them here."""
        for ident, (ref, aliases) in list(self.watch.items()):
            st = ref()
            if st is not None and torch._C._storage_Use_Count(st._cdata) <= aliases + 1:
                self.b.add(UNREF, ident, st.nbytes())
                del self.watch[ident]

    def step_cost(self) -> tuple[float, float]:
        f, m = self.flops, self.moved
        self.flops = self.moved = 0.0
        return f, m


def capture(model: str, batch: int, steps: int = 3, size: Optional[int] = None, progress: bool = True) -> Trace:
    """Records ``steps`` training steps of ``model`` (a key of MODELS) at ``batch`` on the meta device."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}: choose one of {', '.join(MODELS)}")
    if batch < 1 or steps < 1:
        raise ValueError("batch and steps must be at least 1")
    build, default_size = MODELS[model]
    size = size or default_size
    dtype = torch.bfloat16 if model.endswith("bf16") else torch.float32
    b = _Builder()
    rec = _Recorder(b)
    with torch.device("meta"):
        net = build().to(dtype)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    for p in list(net.parameters()) + list(net.buffers()):
        rec.alloc_id(p.untyped_storage(), TAG["weight"])

    class Handle:
        __slots__ = ("alias", "ident")

    def pack(t: torch.Tensor) -> Any:
        st = t.untyped_storage()
        ident = rec.alloc_id(st)
        if b.tags.get(ident) in (TAG["weight"], TAG["input"]):
            return t
        h = Handle()
        h.alias, h.ident = t.detach(), ident
        b.tags.setdefault(ident, TAG["activation"])
        ref, aliases = rec.watch.get(ident, (weakref.ref(st), 0))
        rec.watch[ident] = (ref, aliases + 1)
        f, m = rec.step_cost()
        b.add(SAVE, ident, st.nbytes(), f, m)
        return h

    def unpack(h: Any) -> torch.Tensor:
        if isinstance(h, torch.Tensor):
            return h
        f, m = rec.step_cost()
        b.add(USE, h.ident, h.alias.untyped_storage().nbytes(), f, m)
        return h.alias

    gc_was = gc.isenabled()
    gc.disable()  # frees happen when references go, not when a collection runs
    t0 = time.perf_counter()
    try:
        with rec, torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            for it in range(steps):
                b.add(ITER_BEGIN, it)
                x, y = models.example_batch(net, batch, size, torch.Generator().manual_seed(it), "meta")
                if x.is_floating_point():
                    x = x.to(dtype)
                for t in (x, y):
                    b.tags[rec.alloc_id(t.untyped_storage())] = TAG["input"]
                opt.zero_grad(set_to_none=True)
                loss = models.loss_fn(net, net(x), y)
                rec.accumulation.watch(loss.grad_fn)
                loss.backward()
                rec.accumulation.remove()
                for p in net.parameters():
                    b.tags[rec.alloc_id(p.grad.untyped_storage())] = TAG["grad"]
                before = set(rec.ids)
                opt.step()
                for st in (s for s in opt.state.values() for s in s.values() if isinstance(s, torch.Tensor)):
                    if id(st.untyped_storage()) not in before or it == 0:
                        b.tags[rec.alloc_id(st.untyped_storage())] = TAG["optimizer_state"]
                del x, y, loss
                f, m = rec.step_cost()  # the rest of backward and the optimizer step
                b.add(ITER_END, it, 0, f, m)
                if progress:
                    elapsed = time.perf_counter() - t0
                    print(f"  captured {model} batch {batch}: step {it + 1}/{steps} ({len(b.rows)} events, "
                          f"{elapsed:.1f} s)", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        if gc_was:
            gc.enable()
    meta = {
        "format_version": FORMAT_VERSION, "source": "capture", "model": model, "batch": batch, "size": size,
        "dtype": str(dtype).replace("torch.", ""), "steps": steps,
    }  # fmt: skip
    return b.build(meta)


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
    b = _Builder()
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
            b.rows.append((ALLOC, next_id, size, e.get("stream", 0), 0.0, 0.0))
            next_id += 1
        elif action == "free_completed" and addr in live:
            ident, size = live.pop(addr)
            b.rows.append((FREE, ident, size, e.get("stream", 0), 0.0, 0.0))
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
            from bench.swap_trace import swapped

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


def live_peak(trace: Trace) -> int:
    """The most bytes of tensors alive at once: the trace's peak requested memory."""
    live = peak = 0
    for o, s in zip(trace.op.tolist(), trace.size.tolist()):
        if o == ALLOC:
            live += s
            peak = max(peak, live)
        elif o == FREE:
            live -= s
    return peak


CACHE = Path(__file__).resolve().parents[1] / "build" / "trace-cache"


def cached_capture(model: str, batch: int, steps: int, size: Optional[int] = None) -> Trace:
    """``capture``, kept under build/trace-cache (traces are regenerated on demand, never committed)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"{model}_b{batch}{'' if size is None else f'_n{size}'}_s{steps}.npz"
    if path.exists():
        try:
            return Trace.load(path)
        except (ValueError, OSError):
            pass  # an older format: capture again
    t0 = time.perf_counter()
    trace = capture(model, batch, steps, size, progress=False)
    trace.save(path)
    print(f"  captured {model} batch {batch} ({len(trace)} events) in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr, flush=True)  # fmt: skip
    return trace


def summary(t: Trace) -> str:
    peak = live_peak(t)
    m = t.meta
    what = f"{m.get('model', m.get('source'))} batch {m.get('batch', '?')}" + (" (swapped)" if "swap" in m else "")
    return f"{what}: {len(t)} events, {t.allocations()} allocations, peak live {peak / 2**30:.2f} GiB"


if __name__ == "__main__":
    sys.exit(main())
