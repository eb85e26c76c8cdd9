"""The allocation trace of training steps: one event per allocation, free, save, use and operator.

Note [Trace file format]
A trace is one ``.npz`` (numpy, compressed) with parallel arrays, one entry per event:

- ``op`` (uint8): 0 alloc, 1 free, 2 save (an activation is saved for backward), 3 use (backward reads
  it), 4 iteration begin, 5 iteration end, 6 unref (the forward itself no longer holds the activation: were
  autograd not keeping it, it would be freed here), 7 operator (one dispatched operator that reads or
  writes a tensor; views, which move nothing, and markers without tensors are left out).
- ``id`` (int64): the allocation (alloc/free/unref; for save/use the activation's allocation), the
  iteration number (4/5), or for an operator its name, an index into ``meta["ops"]`` ("aten.mm.default").
- ``size`` (int64): bytes (alloc/free/save/use); 0 on operators.
- ``tag`` (uint8): what the allocation is (``TAGS``), on alloc and free.
- ``stream`` (int64): the stream (0 for captured traces).
- ``flops``, ``bytes`` (float64): on an operator event, that operator's own FLOPs (torch's flop counter
  formulas; 0 for operators it has none for) and bytes read and written (its tensor arguments and outputs,
  and what in-place foreach kernels write without returning). These are authoritative: every other event
  of a format-6 trace carries 0. Older traces (format 5) and imported snapshots have no operator events;
  there the save/use events carry the sums over the operators since the previous save/use, and iteration
  end those after the last one, and a consumer prices those sums instead (``swap.forecast.pricing``).
- ``module`` (int32): on an operator, the innermost module running it, an index into ``meta["modules"]``
  (module paths, the root model by its class name); -1 outside any module (the loss, the optimizer, the
  engine's gradient sums). In the backward, an operator is attributed to the module whose forward created
  the autograd node that runs it (Note [Modules of backward operators] in swap.capture.where).
- ``phase`` (int8): on an operator, when it ran (``PHASES``): "batch" (making the inputs), "forward" (the
  loss included), "backward", "recompute" (forward operators rerun during the backward with grad mode on:
  ``torch.utils.checkpoint``, Hugging Face's gradient checkpointing), "optimizer".
- ``precision`` (int8): on an operator, the peak it runs at (``PRECISIONS``): 1 when its first
  floating-point argument (or output, for operators without one) is bf16 or fp16 (tensor cores), else 0
  (fp32; also fp64 and integer operators, which are memory-bound).

module, phase and precision are -1 on other events. The allocations an operator returns (alloc events) come
directly after its operator event, before any other operator's, so each allocation, and hence each saved
activation, names the operator that produced it: the nearest operator event before its alloc. Allocations
not preceded by an operator (parameters and buffers before the first iteration) were made outside the
captured operators. An operator whose result eager PyTorch writes into an operand (autograd's in-place
gradient sums) has an operator event and no alloc.

``meta`` is a JSON string: format version, model, batch, dtype, steps, how it was made, and the ``ops`` and
``modules`` tables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

ALLOC, FREE, SAVE, USE, ITER_BEGIN, ITER_END, UNREF, OP = range(8)
TAGS = ("temporary", "activation", "weight", "grad", "optimizer_state", "input")
TAG = {name: i for i, name in enumerate(TAGS)}
PHASES = ("batch", "forward", "backward", "recompute", "optimizer")
PHASE = {name: i for i, name in enumerate(PHASES)}
PRECISIONS = ("fp32", "bf16/fp16")
FP32, LOW_PRECISION = 0, 1
# 4: meta-device storages only, CUDA kernel choices; 5: also in-place gradient sums, foreach writes counted;
# 6: operator events carry the costs (module, phase, precision per operator)
FORMAT_VERSION = 6
READABLE_VERSIONS = (5, 6)  # 5: costs summed per segment on save/use/iteration end, no operator events
_PER_EVENT = ("module", "phase", "precision")  # -1 where not an operator event


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
    module: Optional[np.ndarray] = None  # int32; None: -1 everywhere (a trace without operator events)
    phase: Optional[np.ndarray] = None  # int8
    precision: Optional[np.ndarray] = None  # int8

    def __post_init__(self) -> None:
        for name, dtype in zip(_PER_EVENT, (np.int32, np.int8, np.int8)):
            if getattr(self, name) is None:
                setattr(self, name, np.full(len(self.op), -1, dtype=dtype))

    def __len__(self) -> int:
        return len(self.op)

    def has_ops(self) -> bool:
        """Whether operators are recorded one by one (format 6 captures), not summed per segment."""
        return bool(np.any(self.op == OP))

    def op_name(self, k: int) -> str:
        """The operator name of operator event ``k``."""
        return self.meta["ops"][int(self.id[k])]

    def module_name(self, k: int) -> Optional[str]:
        """The module path of operator event ``k`` (None outside any module)."""
        m = int(self.module[k])
        return self.meta["modules"][m] if m >= 0 else None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        np.savez_compressed(
            path, op=self.op, id=self.id, size=self.size, tag=self.tag, stream=self.stream, flops=self.flops,
            bytes=self.bytes, module=self.module, phase=self.phase, precision=self.precision,
            meta=np.array(json.dumps(self.meta)),
        )  # fmt: skip
        return path if path.suffix == ".npz" else path.with_suffix(path.suffix + ".npz")

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Reads a trace of this format or an older readable one (``READABLE_VERSIONS``)."""
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("format_version") not in READABLE_VERSIONS:
                raise ValueError(f"{path}: trace format {meta.get('format_version')} is not one of "
                                 f"{READABLE_VERSIONS}: capture it again")  # fmt: skip
            extra = {name: z[name] for name in _PER_EVENT if name in z.files}
            return cls(z["op"], z["id"], z["size"], z["tag"], z["stream"], z["flops"], z["bytes"], meta, **extra)

    def iterations(self) -> list[tuple[int, int]]:
        """(begin, end) event indices of each iteration."""
        begins = np.flatnonzero(self.op == ITER_BEGIN)
        ends = np.flatnonzero(self.op == ITER_END)
        return list(zip(begins.tolist(), ends.tolist()))

    def allocations(self) -> int:
        return int((self.op == ALLOC).sum())


class TraceBuilder:
    """Collects events row by row; ``build`` makes the arrays (tags looked up per allocation, operator and
    module names interned into ``meta["ops"]`` and ``meta["modules"]``)."""

    def __init__(self) -> None:
        # op, id, size, stream, flops, bytes, module, phase, precision
        self.rows: list[tuple[int, int, int, int, float, float, int, int, int]] = []
        self.tags: dict[int, int] = {}
        self.ops: dict[str, int] = {}
        self.modules: dict[str, int] = {}

    def add(self, op: int, ident: int, size: int = 0, flops: float = 0.0, nbytes: float = 0.0, stream: int = 0) -> None:
        self.rows.append((op, ident, size, stream, flops, nbytes, -1, -1, -1))

    def add_op(self, name: str, flops: float, nbytes: float, module: int, phase: int, precision: int) -> None:
        """One operator event; ``module`` from ``module_index`` (or -1)."""
        ident = self.ops.setdefault(name, len(self.ops))
        self.rows.append((OP, ident, 0, 0, flops, nbytes, module, phase, precision))

    def module_index(self, path: str) -> int:
        return self.modules.setdefault(path, len(self.modules))

    def build(self, meta: dict) -> Trace:
        a = np.array(self.rows, dtype=np.float64).reshape(-1, 9)
        ops = a[:, 0].astype(np.uint8)
        ids = a[:, 1].astype(np.int64)
        tags = np.array(
            [self.tags.get(i, 0) if o in (ALLOC, FREE) else 0 for o, i in zip(ops.tolist(), ids.tolist())],
            dtype=np.uint8,
        )
        # Sizes go through int64 directly: float64 rows would round sizes above 2**53 bytes.
        sizes = np.array([r[2] for r in self.rows], dtype=np.int64)
        meta = dict(meta, ops=list(self.ops), modules=list(self.modules))
        return Trace(ops, ids, sizes, tags, a[:, 3].astype(np.int64), a[:, 4], a[:, 5], meta,
                     a[:, 6].astype(np.int32), a[:, 7].astype(np.int8), a[:, 8].astype(np.int8))  # fmt: skip


def live_peak(trace: Trace) -> int:
    """The most bytes of tensors alive at once: the trace's peak requested memory."""
    delta = np.where(trace.op == ALLOC, trace.size, 0) - np.where(trace.op == FREE, trace.size, 0)
    return int(max(0, np.cumsum(delta).max(initial=0)))


def summary(t: Trace) -> str:
    peak = live_peak(t)
    m = t.meta
    what = f"{m.get('model', m.get('source'))} batch {m.get('batch', '?')}" + (" (swapped)" if "swap" in m else "")
    return f"{what}: {len(t)} events, {t.allocations()} allocations, peak live {peak / 2**30:.2f} GiB"
