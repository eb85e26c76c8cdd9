"""The conservative plan of profiling iterations: what it holds, and what it keeps for a near use. The executor
(swap.runtime.activations.executor) takes each step and hands it here while it profiles.

Note [Budget-aware profiling]
The conservative plan holds as little as any plan can: a variable's copy to host starts when it is saved,
and its device copy is dropped at the next step; a use fetches its variable, or re-attaches the forward's
storage when someone still holds it (a second copy would only add memory). So a profiling step needs no
more than its floor (swap.schedule.budget.step_floors). The one optional extra is a prefetch: the second
profiling iteration fetches the next use of the first one ahead of time, and only when what is live, the
variable, and what the step allocated last time fit the budget. The first iteration fetches on demand. Whatever
our own copies, everything is released when a backward pass ends, so nothing of ours is held across the
optimizer step.

Note [Kept for a near use]
The conservative plan drops each variable at the step after its access, so a variable that backward reads
many times (a state-space model's reference scan reads its discretized inputs once per time step) was
fetched again for every use: a profiling iteration moved 2 GiB back for 62 MiB sent out. The second
profiling iteration knows the first one's steps; a variable whose next use there is at most
``NEAR_USE_STEPS`` steps away stays on the device until it, when every step in between still fits the
budget with it: each step's floor (its measured memory that is not ours, the variable it accesses and those
the forward pass or a backward node still holds), what is kept already, and what this iteration began with
above the profiled one (the optimizer's state made since). The first iteration, which knows nothing ahead,
fetches at every use.

Only a copy we fetched, of a variable whose forward storage is gone, is kept, and once kept it is never
dropped before the use it is kept for: the profile learns who else holds a variable from when its storages
die (``held_until``: the forward's storage, Note [A fetched copy held past its node]: a fetched copy), and a
storage we keep alive dies later than the conservative plan would let it, which would read as someone
else holding it (an inflated profile, and a budget that no longer fits).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ...schedule.budget import step_floors
from ...schedule.sequence import SAVE, USE, Sequence
from ..machine.memory import DeviceMemory
from .tracer import Variable
from .transfers import Transfers

NEAR_USE_STEPS = 16  # Note [Kept for a near use]


def near_use(prev: Sequence, prev_next: list[int], floors: list[int], last: int, i: int, nbytes: int,
             budget: int) -> Optional[int]:  # fmt: skip
    """The step of the next use, in the previous profile ``prev`` (``prev_next``: its ``next_access()``;
    ``floors``: its step floors), of a variable accessed last at step ``last``, when it may stay on the device
    from step ``i`` until then holding ``nbytes`` with it (the variable and what is kept already) within
    ``budget``; else None (Note [Kept for a near use])."""
    if not 0 <= last < len(prev):
        return None
    nxt = prev_next[last]
    if nxt >= len(prev) or nxt - i > NEAR_USE_STEPS or prev.kind[nxt] != USE:
        return None
    room = budget - nbytes
    return nxt if all(floors[k] <= room for k in range(i, nxt)) else None


class ConservativePlan:
    """One profiling iteration's own variables on the device: those held until the next step, the one
    prefetched, and those kept for a near use (Note [Budget-aware profiling], Note [Kept for a near use]).
    ``log(i, action, var)`` records what step ``i`` issued."""

    def __init__(self, transfers: Transfers, memory: DeviceMemory, budget: int,
                 log: Callable[[int, str, Variable], None]) -> None:  # fmt: skip
        self.transfers = transfers
        self.memory = memory
        self.budget = budget
        self.log = log
        self.held: list[Variable] = []  # ours until the next step (or a near use)
        self.prefetched: Optional[Variable] = None
        self._prev: Optional[Sequence] = None
        self._prev_next: list[int] = []
        self._floors: list[int] = []
        self._until: dict[int, int] = {}  # variable -> the step of the near use it is kept for

    def restart_window(self) -> None:
        """After a step's releases: the step's window starts from what is left (Note [Step windows])."""
        self.memory.window_peak()
        self.memory.held_window_peak()

    def forget(self) -> None:
        """The iteration ended (its variables released by the executor)."""
        self.held, self.prefetched, self._until = [], None, {}

    def release_all(self) -> None:
        """Everything of ours leaves the device (a backward pass ended)."""
        for v in self.held:
            self.transfers.release(v)
        self.forget()

    def _near_use(self, prev: Sequence, v: Variable, i: int, nbytes: int) -> Optional[int]:
        if prev is not self._prev:
            self._prev, self._prev_next, self._floors = prev, prev.next_access(), step_floors(prev)
        return near_use(prev, self._prev_next, self._floors, v.last_access, i, nbytes, self.budget)

    def step(self, var: Variable, kind: str, storage: Optional[torch.UntypedStorage], i: int,
             variables: list[Variable], prev: Optional[Sequence], grown: int = 0) -> None:  # fmt: skip
        """Step ``i`` accesses ``var`` (``storage``: a save's); ``prev`` is the previous profile while this
        iteration repeats it (None otherwise: nothing ahead is known), ``grown`` the memory live at this
        iteration's start above the profiled one's (the optimizer's state made since)."""
        moves = self.transfers
        # Kept until the next step: those with no copy yet (left by a plan), and, while the profile holds, those
        # kept for a near use, until it (Note [Kept for a near use]).
        keep = [v for v in self.held if v is not var and v is not self.prefetched and v.alive and v.dev is not None
                and (v.host is None or prev is not None and self._until.get(v.id, -1) > i)]  # fmt: skip
        for v in keep:
            moves.swap_out(v, None)
        ours = sum(v.size for v in keep) + (self.prefetched.size if self.prefetched is not None else 0)
        for v in self.held:
            if v is var or v is self.prefetched or v in keep:
                continue
            nxt = None
            if prev is not None and v.alive and v.dev is not None and v.dev_is_copy and v.original() is None:
                nxt = self._near_use(prev, v, i, ours + v.size + grown)
            if nxt is not None:
                keep.append(v)  # Note [Kept for a near use]
                self._until[v.id] = nxt
                ours += v.size
            else:
                moves.release(v)
        self.held = keep
        self.restart_window()
        if kind == SAVE:
            if var.dev is None:
                var.attach(storage)
            self.log(i, "access", var)
            moves.swap_out(var, i)
        else:
            moves.ensure_resident(var, i)
            if self.prefetched is var:
                self.prefetched = None
            self.log(i, "access", var)
            self._prefetch_next(var, i, variables, prev)
        self.held.append(var)

    def _prefetch_next(self, var: Variable, i: int, variables: list[Variable], prev: Optional[Sequence]) -> None:
        """Fetch the variable the previous profile used next, if it fits (Note [Budget-aware profiling])."""
        if prev is None or self.prefetched is not None:
            return
        nxt = next((j for j in range(i + 1, len(prev)) if prev.kind[j] == USE), None)
        if nxt is None or prev.var[nxt] >= len(variables):
            return
        u = variables[prev.var[nxt]]
        if u is var or u.dev is not None or u.host is None or not u.alive:
            return
        if self.memory.current() + u.size + prev.transient[i] > self.budget:
            return
        self.transfers.swap_in(u, i)
        self.prefetched = u
