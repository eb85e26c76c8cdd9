"""The allocation trace of training steps: one event per allocation, free, save and use.

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

and ``meta``, a JSON string: format version, model, batch, dtype, steps, how it was made.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ALLOC, FREE, SAVE, USE, ITER_BEGIN, ITER_END, UNREF = range(7)
TAGS = ("temporary", "activation", "weight", "grad", "optimizer_state", "input")
TAG = {name: i for i, name in enumerate(TAGS)}
# 4: meta-device storages only, CUDA kernel choices; 5: also in-place gradient sums, foreach writes counted
FORMAT_VERSION = 5


@dataclass
class Trace:
    """Parallel event arrays (Note [Trace file format]) and ``meta``."""

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


class TraceBuilder:
    """Collects events row by row; ``build`` makes the arrays (tags looked up per allocation)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int, int, float, float]] = []  # op, id, size, stream, flops, bytes
        self.tags: dict[int, int] = {}

    def add(self, op: int, ident: int, size: int = 0, flops: float = 0.0, nbytes: float = 0.0, stream: int = 0) -> None:
        self.rows.append((op, ident, size, stream, flops, nbytes))

    def build(self, meta: dict) -> Trace:
        a = np.array(self.rows, dtype=np.float64).reshape(-1, 6)
        ops = a[:, 0].astype(np.uint8)
        ids = a[:, 1].astype(np.int64)
        tags = np.array(
            [self.tags.get(i, 0) if o in (ALLOC, FREE) else 0 for o, i in zip(ops.tolist(), ids.tolist())],
            dtype=np.uint8,
        )
        # Sizes go through int64 directly: float64 rows would round sizes above 2**53 bytes.
        sizes = np.array([r[2] for r in self.rows], dtype=np.int64)
        return Trace(ops, ids, sizes, tags, a[:, 3].astype(np.int64), a[:, 4], a[:, 5], meta)


def live_peak(trace: Trace) -> int:
    """The most bytes of tensors alive at once: the trace's peak requested memory."""
    delta = np.where(trace.op == ALLOC, trace.size, 0) - np.where(trace.op == FREE, trace.size, 0)
    return int(max(0, np.cumsum(delta).max(initial=0)))


def summary(t: Trace) -> str:
    peak = live_peak(t)
    m = t.meta
    what = f"{m.get('model', m.get('source'))} batch {m.get('batch', '?')}" + (" (swapped)" if "swap" in m else "")
    return f"{what}: {len(t)} events, {t.allocations()} allocations, peak live {peak / 2**30:.2f} GiB"
