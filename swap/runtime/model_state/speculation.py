"""Speculative host steps: a bucket's update starts during the backward, is kept when ``opt.step()`` confirms its
inputs, and is rolled back exactly otherwise.

Note [Speculative host steps]
A bucket's host step (Note [Host step after confirmation] in host_step) needs four inputs: the host master, the
optimizer state, the gradient and the param group's hyperparameters. During the backward, once every gradient of
an offloaded bucket has arrived (or at the backward's end, for a bucket some of whose parameters got none), the
host worker *speculates*: it saves the bucket's master and state (copies, ``save``), notes a signature of every
gradient it reads (``Signature``), and steps the bucket with the hyperparameters as they are then. At
``opt.step()`` the same inputs are taken again, and the worker compares (``Speculation.holds``):

- equal: the update already made is the update the step would make (the same kernel on the same bytes: the fused
  kernel is elementwise and deterministic), so it is kept (*committed*) and the copies freed;
- different: the copies are put back (``restore``: the master and every state tensor byte for byte, state the
  parameter did not have removed) and the step runs on the real inputs (*rolled back and redone*).

Any reader of the master before ``opt.step()`` confirms (the next micro-batch's forward, a state dict, the
manager's exit: every one waits on the bucket first, update-before-use) rolls the bucket back before it reads, so
nothing outside sees an update ``opt.step()`` did not make. That covers every way a step differs from the
speculation: clipping whose coefficient is not 1 (the gradients change), GradScaler's unscaling (it changes them;
a step it skips for an inf never comes, so the next forward rolls back), another micro-batch (its gradients arrive
into the buffer), hyperparameters or param groups changed between the backward and the step (a scheduler stepped
there, an ``lr`` written by hand), ``zero_grad`` or a loop that skips ``opt.step()``. The result is bitwise plain
training's in every case: either the kept update is the one the step makes, or the step is made afresh from the
restored bytes.

A gradient's signature is (whether it has one this step, a count the gradient sink bumps at every write it makes
or hands out, the tensor's version counter). The count catches what the version counter does not see: a new
backward's copy, ``zero_grad``, GradScaler's unscaling (its kernel does not bump versions), and a user's read of
``p.grad`` between the backward and the step (the reader holds the buffer and may write it through ``.data`` or
numpy, which no counter sees: a read therefore counts as a write, the conservative choice). A clip whose
coefficient is exactly 1 leaves the host gradients untouched (multiplying by 1.0 changes no float), so a clip that
does not bind keeps the speculation.

Note [When to speculate]
Speculation is on by default, because it is exact (above), when its copies fit: the rollback copies of every
offloaded bucket at once (master and state: Note [Rollback copies] in swap.schedule.model_state.ledger) must fit
the host memory beside the rest (``ledger.speculates``, the rule the forecast prices too: Note [What the runtime
runs] in swap/forecast/offload.py), else it is off and the report says why. Its cost when it fails is host work
thrown away and the copies, so a ``SpeculationPolicy`` learns the loop: it speculates only in the backward that the
last step's number of backward passes says is the last one before ``opt.step()`` (gradient accumulation speculates
on the last micro-batch), and after a failed speculation it pauses for 1, 2, 4, ... up to 64 steps, retrying after
each pause (a loop whose clipping binds every step, or that unscales with a GradScaler every step, wastes about one
speculation in 64; one whose clipping stops binding gets it back).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

Signature = tuple[bool, int, int]  # (has a gradient, the sink's write count, the tensor's version counter)
Saved = list[tuple[torch.Tensor, torch.Tensor, Optional[dict[str, Any]]]]  # (master, its copy, state copy or None)


def save(state: dict[Any, dict[str, Any]], masters: list[torch.Tensor],
         spare: Optional[dict[int, dict[Any, Any]]] = None) -> Saved:  # fmt: skip
    """Copies of ``masters`` and of their optimizer ``state`` (None where a master has none yet), made into the
    buffers ``spare`` keeps for each master from its last speculation where they fit (allocating fresh host
    memory at every step costs page faults that take longer than the copy), and kept there for the next."""
    out: Saved = []
    spare = {} if spare is None else spare
    with torch.no_grad(), _disable_current_modes():
        for hp in masters:
            mine = spare.setdefault(id(hp), {})
            st = state.get(hp)
            kept = None if st is None else {k: _copy(v, mine, k) for k, v in st.items()}
            out.append((hp, _copy(hp, mine, None), kept))
    return out


def _copy(v: Any, buffers: dict[Any, Any], key: Optional[str]) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    buf = buffers.get(key)
    if not (isinstance(buf, torch.Tensor) and buf.shape == v.shape and buf.dtype == v.dtype
            and buf.stride() == v.stride()):  # fmt: skip
        buf = buffers[key] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
    return buf.copy_(v)


def restore(state: dict[Any, dict[str, Any]], saved: Saved) -> None:
    """Masters and state back to the bytes ``save`` copied (state tensors written in place, so references to them
    stay valid; state a master did not have is removed). Python dispatch off: a meter of the compute device must
    not take host memory for its own (Note [Host pool on CPU runs]); a rollback may run on the compute thread."""
    with torch.no_grad(), _disable_current_modes():
        for hp, copy, kept in saved:
            hp.copy_(copy)
            if kept is None:
                state.pop(hp, None)
                continue
            st = state.setdefault(hp, {})
            for k in [k for k in st if k not in kept]:
                del st[k]
            for k, v in kept.items():
                now = st.get(k)
                if isinstance(v, torch.Tensor) and isinstance(now, torch.Tensor) and now.shape == v.shape \
                        and now.dtype == v.dtype:  # fmt: skip
                    now.copy_(v)
                else:
                    st[k] = v


def saved_bytes(saved: Optional[Saved]) -> int:
    """Host bytes the copies of a speculation take."""
    if not saved:
        return 0
    n = 0
    for _, copy, kept in saved:
        n += copy.untyped_storage().nbytes()
        for v in (kept or {}).values():
            if isinstance(v, torch.Tensor):
                n += v.untyped_storage().nbytes()
    return n


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and bool(torch.equal(a, b)))  # fmt: skip
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))


def same_hyper(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> bool:
    """Whether two snapshots of the shadow groups' hyperparameters are equal (tensors by value and dtype)."""
    return a.keys() == b.keys() and all(a[s].keys() == b[s].keys() and all(_same(a[s][k], b[s][k]) for k in a[s])
                                        for s in a)  # fmt: skip


@dataclass
class Speculation:
    """One bucket's speculative host step (Note [Speculative host steps]): the step ``number`` it hopes to be, the
    hyperparameters it ran with, and, once the worker ran it, the signatures of the gradients it read, the
    (shadow group, master) pairs it stepped and the copies to restore."""

    bucket: int
    number: int
    hyper: dict[int, dict[str, Any]]
    future: Optional[Future] = None
    sigs: dict[int, Signature] = field(default_factory=dict)
    stepped: list[tuple[int, int]] = field(default_factory=list)
    saved: Optional[Saved] = None
    seconds: float = 0.0  # host optimizer seconds it took (its copies included)
    valid: bool = True  # False: something wrote the bucket's weights since (a write-back of its device copy)

    def holds(self, sigs: dict[int, Signature], stepped: list[tuple[int, int]],
              hyper: dict[int, dict[str, Any]]) -> bool:  # fmt: skip
        """Whether the step's inputs are the ones the speculation read."""
        return self.valid and self.sigs == sigs and self.stepped == stepped and same_hyper(self.hyper, hyper)


class SpeculationPolicy:
    """Note [When to speculate]: which backward passes speculate."""

    MAX_PAUSE = 64

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.lock = threading.Lock()
        self.cycle = 0  # backward passes since the last opt.step() or zero_grad
        self.expected = 1  # backward passes the last step had
        self.failures = 0  # steps in a row with a failed speculation
        self.pause = 0  # steps left without speculating
        self._failed_step = -1  # the last step number a speculation failed for (one failure a step)

    def now(self) -> bool:
        """Whether the backward under way speculates."""
        with self.lock:
            return self.enabled and self.pause == 0 and self.cycle + 1 >= self.expected

    def backward_ended(self) -> None:
        with self.lock:
            self.cycle += 1

    def zeroed(self) -> None:
        """``zero_grad``: an accumulation starts afresh."""
        with self.lock:
            self.cycle = 0

    def stepped(self) -> None:
        """``opt.step()``: the backward passes it took are what the next step is expected to take."""
        with self.lock:
            self.expected, self.cycle = max(self.cycle, 1), 0
            if self.pause:
                self.pause -= 1

    def failed(self, number: int) -> None:
        """A speculation for step ``number`` was undone (counted once a step, however many buckets)."""
        with self.lock:
            if number == self._failed_step:
                return
            self._failed_step = number
            self.failures += 1
            self.pause = min(2 ** (self.failures - 1), self.MAX_PAUSE)

    def kept(self) -> None:
        with self.lock:
            self.failures = 0
