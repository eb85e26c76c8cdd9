"""The operator table (Note [Operator table] in swap.joint.ops) of a captured trace, without running the model.

Note [Operator table from a trace]
A format-6 trace (Note [Trace file format]) records every dispatched operator with its name, FLOPs, bytes,
innermost module and phase; the allocations it returns follow its event. Its autograd node saves its inputs
before the kernel runs (so before its event) and its outputs after the kernel returns (after its event and
its allocations): the saves between two operators' events are the first one's saved outputs, then the next
one's saved inputs. Which operators save an output is read from torch's derivatives table (Note [Operators
that save their output] in swap.joint.autograd_saves). So per forward operator of one iteration:

- ``outputs``: the allocations after its event, those of at least ``min_bytes``, each numbered as the
  Sequence of the same trace numbers its variables (``sequence_from_trace``: first-save order), or ``-1 -
  allocation id`` when never saved; ``inputs``: the other storages its node saved. The trace does not
  record the inputs an operator reads without saving them; the elementwise rebuilds only need the saved one.
- ``seconds``: the operator on the device's roofline (Note [Per-operator roofline]); a rerun is priced the
  same way, since it runs the same operators.
- ``step``: the saves and uses of at least ``min_bytes`` before it, as the Sequence counts steps.
- ``keepable``: it returns an allocation, writes nothing in place (the overload's name ends in ``_``, or
  its schema says so), and draws no random numbers (the ``nondeterministic_seeded`` tag); an output that a
  later in-place operator saves again (``relu_`` after a BatchNorm) is written by it, so not keepable.
- ``blocker``: only what a name tells (``.item()``'s host sync, collectives, non-deterministic CUDA
  kernels when the capture mirrored CUDA): a generator passed as an argument is not in the trace.

Region calls are runs of consecutive forward operators inside one candidate module (a path ending in an
index: Note [Candidate regions]); a module called twice in a row is one call. A call's inputs are the
storages saved inside it that were allocated before it began (a block's input, read by its first norm or
convolution); the trace does not show arguments that are never saved. A module whose operators also ran in
the "recompute" phase is the user's own checkpoint, and is not checkpointed again.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import numpy as np

from ..capture.trace import ALLOC, OP, PHASE, SAVE, USE, Trace
from ..devices import DeviceProfile
from ..joint.autograd_saves import saves_first_output
from ..joint.ops import Op, OpTable, RegionCall, in_place_name, is_index
from .pricing import event_seconds

# What a name alone says cannot be rerun (Note [Operators that cannot be rerun] in swap.runtime.auto.op_facts).
HOST_SYNC = ("aten._local_scalar_dense.default", "aten.item.default")
COLLECTIVES = ("c10d.", "_c10d_functional.", "c10d_functional.", "_dtensor.")
ATOMIC_ON_CUDA = ("aten.index_add", "aten.scatter_add", "aten.scatter_reduce", "aten.index_put",
                  "aten._index_put_impl_", "aten.put", "aten.bincount", "aten.histc", "aten.embedding_bag",
                  "aten._embedding_bag")  # fmt: skip


@functools.cache
def facts_of(name: str) -> tuple[bool, bool]:
    """(writes or aliases an argument, draws random numbers) for an operator name such as
    ``aten.add_.Tensor``, from its schema and tags when torch knows it, else from the name."""
    parts = name.split(".")
    inplace = in_place_name(name)
    try:
        import torch

        op = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2] if len(parts) > 2 else "default")
        inplace = inplace or any(r.alias_info is not None for r in op._schema.returns)
        return inplace, torch.Tag.nondeterministic_seeded in op.tags
    except (AttributeError, IndexError, RuntimeError):
        return inplace, any(w in name for w in ("dropout", "bernoulli", "rand", "normal", "uniform"))


def blocker_of(name: str, cuda: bool) -> str:
    """Why an operator of this name cannot be rerun, as far as its name tells ("" if it can)."""
    if name in HOST_SYNC:
        return "a host sync that reads a value (.item())"
    if name.startswith(COLLECTIVES):
        return "a collective (a rerun would make other ranks wait for it)"
    if cuda and name.startswith(ATOMIC_ON_CUDA):
        return "a non-deterministic CUDA kernel (torch.use_deterministic_algorithms is off)"
    return ""


def table_from_trace(trace: Trace, dev: Optional[DeviceProfile] = None, min_bytes: int = 0,
                     iteration: int = -1, seconds: Optional[np.ndarray] = None) -> OpTable:  # fmt: skip
    """The operator table of one iteration of ``trace`` (default: the last), its variables numbered as
    ``sequence_from_trace(trace, iteration, min_bytes=min_bytes)`` numbers them (Note [Operator table from a
    trace]). ``seconds``: each event's seconds (``event_seconds`` of ``dev``), to price once for both."""
    if not trace.has_ops():
        raise ValueError(f"trace of {trace.meta.get('model', '?')} has no operator events (format "
                         f"{trace.meta.get('format_version')}): capture it again with this version of "
                         "swap.capture")  # fmt: skip
    begin, end = trace.iterations()[iteration]
    if seconds is None:
        seconds = event_seconds(trace, dev) if dev is not None else np.zeros(len(trace))
    span = slice(begin, end + 1)
    ops_, ids, sizes = trace.op[span].tolist(), trace.id[span].tolist(), trace.size[span].tolist()
    phase, module = trace.phase[span].tolist(), trace.module[span].tolist()
    names, modules = trace.meta["ops"], trace.meta["modules"]
    root = trace.meta.get("root_module") or next((m for m in modules if "." not in m and m[:1].isupper()), "")
    cuda = trace.meta.get("target", "cuda") == "cuda"
    forward, recompute = PHASE["forward"], PHASE["recompute"]

    var: dict[int, int] = {}  # allocation id -> variable (first-save order, as sequence_from_trace)
    for o, i, s in zip(ops_, ids, sizes):
        if o in (SAVE, USE) and s >= min_bytes and i not in var:
            var[i] = len(var)

    def number(i: int) -> int:
        return var.get(i, -1 - i)

    def path_of(m: int) -> str:
        name = modules[m] if m >= 0 else ""
        return "" if name == root else name

    user_checkpointed = {path_of(m) for p, m in zip(phase, module) if p == recompute and m >= 0}
    rows: list[dict] = []  # forward operators, in order
    alloc_at: dict[int, int] = {}  # allocation id -> index into rows of the operator before it (-1: before any)
    nbytes: dict[int, int] = {}  # allocation id -> bytes
    pending: list[int] = []  # saves since the last forward operator's event
    step = 0

    def split(nxt: Optional[dict]) -> None:
        """Hands the saves since the last operator to it (the outputs its node saved: they come first) and to
        ``nxt`` (the inputs its node saved before it ran)."""
        prev = rows[-1] if rows else None
        tail: list[int] = []
        if prev is not None:
            allocs = prev["allocs"]
            mine = set(allocs[1:])  # a node saves its operator's second outputs (statistics, logsumexp, masks)
            if saves_first_output(prev["name"]):
                mine |= set(allocs[:1]) if allocs else set(pending[:1])  # relu_ saves the storage it wrote
            while len(tail) < len(pending) and pending[len(tail)] in mine and pending[len(tail)] not in tail:
                tail.append(pending[len(tail)])
            prev["saved_out"], prev["tail_end"] = tail, prev["step"] + len(tail)
        if nxt is not None:
            nxt["saved_in"] = pending[len(tail) :]
            nxt["head_step"] = step - len(nxt["saved_in"])
        pending.clear()

    in_forward = False
    for k, (o, i, s) in enumerate(zip(ops_, ids, sizes)):
        if o == OP:
            if phase[k] == forward:
                row = {"name": names[i], "module": path_of(module[k]), "k": begin + k, "step": step, "outs": [],
                       "sizes": [], "allocs": []}  # fmt: skip
                split(row)
                rows.append(row)
                in_forward = True
            elif in_forward:
                split(None)
                in_forward = False
        elif o == ALLOC:
            alloc_at[i] = len(rows) - 1
            nbytes[i] = s
            if in_forward:
                rows[-1]["allocs"].append(i)
            if in_forward and s >= min_bytes:
                rows[-1]["outs"].append(i)
                rows[-1]["sizes"].append(s)
        elif o in (SAVE, USE) and s >= min_bytes:
            if o == SAVE and in_forward:
                pending.append(i)
            step += 1
    if in_forward:
        split(None)

    written_by: dict[int, int] = {}  # storage -> the last in-place operator that saved it (wrote it)
    for j, r in enumerate(rows):
        if facts_of(r["name"])[0] and not r["outs"]:
            for i in r["saved_out"]:
                written_by[i] = j
    table_ops = []
    for j, r in enumerate(rows):
        writes, rng = facts_of(r["name"])
        outs = r["outs"]
        keepable = bool(outs) and not writes and not rng and all(written_by.get(i, -1) <= j for i in outs)
        k = r["k"]
        table_ops.append(Op(
            r["name"], r["module"], float(seconds[k]), float(trace.flops[k]), float(trace.bytes[k]), sum(r["sizes"]),
            r["step"], tuple(number(i) for i in outs), tuple(r["sizes"]),
            tuple(number(i) for i in dict.fromkeys(r["saved_in"]) if i not in outs), keepable,
            blocker_of(r["name"], cuda), rng,
        ))  # fmt: skip
    calls = _calls(rows, alloc_at, nbytes, number, user_checkpointed)
    return OpTable(table_ops, calls)


def _candidates(path: str) -> list[str]:
    """The candidate modules (Note [Candidate regions]) a module path lies in, outermost first."""
    parts = path.split(".") if path else []
    return [".".join(parts[: n + 1]) for n, p in enumerate(parts) if is_index(p)]


def _calls(rows: list[dict], alloc_at: dict[int, int], nbytes: dict[int, int], number: Callable[[int], int],
           user_checkpointed: set[str]) -> list[RegionCall]:  # fmt: skip
    """The calls of candidate modules: runs of consecutive rows inside each (Note [Operator table from a trace]).
    A call's steps run from its first operator's input saves to its last one's output saves."""
    open_: dict[str, int] = {}  # path -> first row
    spans: list[tuple[str, int, int]] = []  # path, first row, end row
    for j, r in enumerate(rows):
        here = _candidates(r["module"])
        for p in [p for p in open_ if p not in here][::-1]:
            spans.append((p, open_.pop(p), j))
        for p in here:
            open_.setdefault(p, j)
    spans += [(p, first, len(rows)) for p, first in reversed(open_.items())]
    spans.sort(key=lambda s: (s[1], -s[2]))
    calls = []
    for path, first, end in spans:
        inputs: dict[int, int] = {}
        for r in rows[first:end]:
            for i in r["saved_in"] + r["saved_out"]:
                if alloc_at.get(i, -1) < first and i not in inputs:
                    inputs[i] = nbytes.get(i, 0)
        why = ""
        hit = next((r["name"] for r in rows[first:end] if facts_of(r["name"])[0] and not r["outs"]
                    and any(i in inputs for i in r["saved_out"])), None)  # fmt: skip
        if hit is not None:
            why = f"{hit} writes one of its inputs in place (autograd would reject the saved input)"
        if any(u == path or u.startswith(path + ".") or path.startswith(u + ".") for u in user_checkpointed if u):
            why = "it runs a torch.utils.checkpoint (or other saved-tensor hooks) of your own inside"
        steps = (rows[first]["head_step"], rows[end - 1]["tail_end"])
        calls.append(RegionCall(path, (first, end), steps, tuple((number(i), b) for i, b in inputs.items()), why))
    return calls
