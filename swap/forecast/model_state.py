"""Model state from a captured trace: the buckets of a model's parameters, where the iteration reads them,
and the trace's own model-state bytes, for the pure plan (swap/schedule/model_state/).

Note [Model state from a trace]
A capture trains the model as the user wrote it, its parameters, gradients and optimizer state on the device
(tagged ``weight``, ``grad``, ``optimizer_state`` in the trace). The plan decides those bytes itself, in the
format the user trains with (``StateFormat``: the bytes a parameter takes as weights, master, gradient and
optimizer state), so ``layout_from_trace`` takes them out of the sequence's ``nonswap`` again: per step, the
least model-state bytes live during the step's interval (the same intervals ``sequence_from_trace`` measures,
so what is left is never less than the step's other bytes). Capture with an optimizer that keeps no state
(plain SGD, ``stateless_optimizer``): its step makes no temporaries the plan would have to account.

The parameters, from the model built on the meta device (``named_parameters``: a shared parameter once), are
ordered by the first forward operator of their module (Note [Modules of backward operators] in
swap.capture.where attributes every operator to a module), those no forward reads last, and packed into
buckets (``pack_buckets``). A bucket is read at the steps whose compute runs its modules' forward operators,
and again at those running their backward (or recompute) operators (``BucketUses``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..capture.trace import ALLOC, FREE, OP, PHASE, SAVE, TAG, USE, Trace
from ..schedule.model_state import (
    STATE_TENSORS,
    Bucket,
    BucketUses,
    ParamInfo,
    default_bucket_bytes,
    pack_buckets,
    state_bytes,
)
from ..schedule.model_state.ledger import accumulation_bytes

STEP_BYTES = 4  # Adam's step counter: an fp32 scalar tensor a parameter, as torch keeps it (the runtime counts it too)
MODEL_TAGS = (TAG["weight"], TAG["grad"], TAG["optimizer_state"])


@dataclass(frozen=True)
class StateFormat:
    """Bytes a parameter takes in each role, and the optimizer: what the plan moves and stores.

    The default is the full fine-tune of a large model: bf16 weights and gradients on the device, fp32 master
    and AdamW state on the host (``cast``: where the master is cast to the weights' dtype, "host" or
    "device"). ``mixed``: as ``SwapManager(compute_dtype=)`` keeps it (Note [Mixed precision] in
    swap.runtime.model_state.precision): the gradients cross the link in the weights' dtype and are upcast into
    host buffers in the master's, only the compute copy is pinned, and no bucket is resident."""

    optimizer: str = "adamw"
    weight: int = 2
    master: int = 4
    grad: int = 2
    state: int = 4  # bytes per element of each optimizer state tensor
    cast: str = "host"
    mixed: bool = False  # the runtime's mixed precision (``Bucket.mixed``: fp32 gradient buffers on the host)

    def __post_init__(self) -> None:
        if self.optimizer not in STATE_TENSORS:
            names = ", ".join(STATE_TENSORS)
            raise ValueError(f"unknown optimizer {self.optimizer!r}: choose one of {names}")
        if self.cast not in ("host", "device"):
            raise ValueError(f"cast must be 'host' or 'device', not {self.cast!r}")

    def param(self, name: str, numel: int) -> ParamInfo:
        return ParamInfo(name, numel, self.weight * numel, self.master * numel, self.grad * numel,
                         state_bytes(self.optimizer, self.state * numel, step_bytes=STEP_BYTES))  # fmt: skip

    def describe(self) -> str:
        def dtype(n: int) -> str:
            return {2: "bf16", 4: "fp32", 8: "fp64", 1: "8-bit"}.get(n, f"{n}-byte")

        if self.mixed:
            return (f"mixed {dtype(self.weight)} compute / {dtype(self.master)} master: {dtype(self.weight)} weights "
                    f"and gradients on the device, {dtype(self.master)} master, gradients and {self.optimizer} state "
                    "on the host, cast on the host")  # fmt: skip
        return (f"{dtype(self.weight)} weights and gradients, {dtype(self.master)} master and {self.optimizer} "
                f"state, cast on the {self.cast}")  # fmt: skip


def stateless_optimizer(params: Any) -> torch.optim.Optimizer:
    """Plain SGD: no state, and an in-place step with no temporaries (Note [Model state from a trace])."""
    return torch.optim.SGD(params, lr=0.01)


@dataclass
class Layout:
    """``layout_from_trace``'s result (Note [Model state from a trace]): the parameters in first-use order and
    where their modules run, packed in the capture's format (``buckets``, ``uses``), and ``pack`` to pack them
    again in another (the runtime's: Note [One packer])."""

    buckets: list[Bucket]
    uses: list[BucketUses]
    trace_bytes: list[int]  # per step: the trace's own model-state bytes to take out of ``nonswap``
    params: int  # parameters, shared ones once
    order: list[tuple[str, int, int]] = field(default_factory=list)  # (name, numel, module) in first-use order
    forward: dict[int, set[int]] = field(default_factory=dict)  # module -> steps its forward operators run in
    backward: dict[int, set[int]] = field(default_factory=dict)  # module -> steps of its backward (or rerun)
    budget: Optional[int] = None  # the device budget the default bucket size is for

    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    def pack(self, fmt: StateFormat, bucket_bytes: Optional[int] = None) -> tuple[list[Bucket], list[BucketUses]]:
        """The parameters packed with their bytes in ``fmt`` into buckets of ``bucket_bytes`` (None: the runtime's
        default for those weights under ``budget``, Note [Bucket size by default]), and where each is read."""
        infos = [fmt.param(name, numel) for name, numel, _m in self.order]
        if bucket_bytes is None:
            bucket_bytes = default_bucket_bytes(sum(p.weight_bytes for p in infos), self.budget)
        buckets = pack_buckets(infos, bucket_bytes)
        if fmt.mixed:
            buckets = [replace(b, mixed=True) for b in buckets]
        module_of = {name: m for name, _n, m in self.order}
        uses = []
        for bucket in buckets:
            ms = {module_of[p] for p in bucket.params}
            uses.append(BucketUses(tuple(sorted(set().union(*(self.forward.get(m, set()) for m in ms)))),
                                   tuple(sorted(set().union(*(self.backward.get(m, set()) for m in ms))))))  # fmt: skip
        return buckets, uses

    def accumulation(self, fmt: StateFormat, bucket_bytes: Optional[int] = None) -> int:
        """Host bytes of the runtime's gradient-accumulation buffer for these parameters in ``fmt`` (Note [Host
        memory before allocating])."""
        infos = [fmt.param(name, numel) for name, numel, _m in self.order]
        if bucket_bytes is None:
            bucket_bytes = default_bucket_bytes(sum(p.weight_bytes for p in infos), self.budget)
        return accumulation_bytes([p.grad_bytes for p in infos], bucket_bytes)


def access_events(trace: Trace, iteration: int = -1, min_bytes: int = 0) -> list[int]:
    """Event indices of the steps of ``sequence_from_trace(trace, iteration, min_bytes=min_bytes)``."""
    b, e = trace.iterations()[iteration]
    op, size = trace.op[b : e + 1], trace.size[b : e + 1]
    return (b + np.flatnonzero(((op == SAVE) | (op == USE)) & (size >= min_bytes))).tolist()


def step_of_events(accesses: list[int], events: np.ndarray) -> np.ndarray:
    """The step whose compute runs each event: step j runs the events after access j up to access j+1
    (inclusive); those before the first access run in step 0 (``sequence_from_trace``)."""
    return np.maximum(0, np.searchsorted(np.asarray(accesses), events, side="left") - 1)


def layout_from_trace(trace: Trace, model_fn: Callable[[], torch.nn.Module], fmt: StateFormat = StateFormat(),
                      bucket_bytes: Optional[int] = None, iteration: int = -1, min_bytes: int = 0,
                      budget: Optional[int] = None) -> Layout:  # fmt: skip
    """The buckets of ``model_fn()``'s parameters in first-use order, where one iteration of ``trace`` reads
    them, and the trace's model-state bytes per step (Note [Model state from a trace]). ``bucket_bytes``: None,
    the runtime's default for these weights under ``budget`` (Note [Bucket size by default])."""
    accesses = access_events(trace, iteration, min_bytes)
    if not accesses:
        raise ValueError("the trace saves nothing for backward: there is no sequence to place weights in")
    b, e = trace.iterations()[iteration]
    modules = trace.meta.get("modules", [])
    ops = np.flatnonzero((trace.op == OP) & (np.arange(len(trace)) >= b) & (np.arange(len(trace)) <= e))
    steps = step_of_events(accesses, ops)
    forward, backward = defaultdict(set), defaultdict(set)
    first_op: dict[int, int] = {}
    phases, mods = trace.phase[ops], trace.module[ops]
    for k, s, ph, m in zip(ops.tolist(), steps.tolist(), phases.tolist(), mods.tolist()):
        if m < 0:
            continue
        if ph == PHASE["forward"]:
            forward[m].add(s)
            first_op.setdefault(m, k)
        elif ph in (PHASE["backward"], PHASE["recompute"]):
            backward[m].add(s)
    with torch.device("meta"):
        model = model_fn()
    index = {path: i for i, path in enumerate(modules)}
    root = type(model).__name__
    named = []
    for name, p in model.named_parameters():
        path = name.rsplit(".", 1)[0] if "." in name else root
        named.append((name, p.numel(), index.get(path, -1)))
    never = len(trace)
    named.sort(key=lambda x: first_op.get(x[2], never))  # stable: unread parameters last, in model order
    layout = Layout([], [], _trace_model_bytes(trace, accesses, e), len(named), named, dict(forward), dict(backward),
                    budget)  # fmt: skip
    layout.buckets, layout.uses = layout.pack(fmt, bucket_bytes)
    return layout


def _trace_model_bytes(trace: Trace, accesses: list[int], end: int) -> list[int]:
    """Per step, the least bytes tagged weight, grad or optimizer state live during its interval, from its
    access to the next (``sequence_from_trace``'s intervals)."""
    op, ident, size, tag = trace.op, trace.id, trace.size, trace.tag
    live: dict[int, int] = {}
    cur = 0
    for k in np.flatnonzero(((op == ALLOC) | (op == FREE)) & (np.arange(len(trace)) < accesses[0])).tolist():
        if op[k] == ALLOC and tag[k] in MODEL_TAGS:
            live[int(ident[k])] = int(size[k])
            cur += int(size[k])
        elif op[k] == FREE and int(ident[k]) in live:
            cur -= live.pop(int(ident[k]))
    out = []
    bounds = accesses
    changes = np.flatnonzero(((op == ALLOC) | (op == FREE)) & (np.arange(len(trace)) >= accesses[0])).tolist()
    j = 0
    for s in range(len(accesses)):
        low = cur
        hi = bounds[s + 1] if s + 1 < len(accesses) else end + 1
        while j < len(changes) and changes[j] < hi:
            k = changes[j]
            if op[k] == ALLOC and tag[k] in MODEL_TAGS:
                live[int(ident[k])] = int(size[k])
                cur += int(size[k])
            elif op[k] == FREE and int(ident[k]) in live:
                cur -= live.pop(int(ident[k]))
            low = min(low, cur)
            j += 1
        out.append(low)
    return out

