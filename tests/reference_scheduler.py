"""The window sweep and prefetch pass as they were before they were made incremental (Note [An incremental
prefetch queue] in swap/schedule/wanted.py), kept as the slow reference that the fast ones must equal exactly.

``RefPlanner`` is the scheduler's ``_Planner`` with the old trigger list, room making and prefetch walk (sort
every wanted use at every step); ``ref_plan`` and ``ref_choose_window`` are ``plan`` and ``choose_window``
with one full ``plan`` (budget check included) per window and every window simulated with its actions."""

from __future__ import annotations

import heapq
from typing import Callable, Optional

from swap.schedule.budget import diagnose
from swap.schedule.scheduler import Schedule, _plan_none, _Planner, validate
from swap.schedule.sequence import SAVE, Sequence
from swap.schedule.simulator import SimResult, simulate


class _Heap:
    """Stands in for ``Wanted``: the old heap of (use step, variable), with nothing kept incrementally."""

    def __init__(self, seq: Sequence) -> None:
        self.var, self.heap = seq.var, []

    def trigger(self, u: int, pending: dict[int, int]) -> None:
        heapq.heappush(self.heap, (u, self.var[u]))

    def reserved(self, v: int, i: int) -> None:
        pass

    def dropped(self, v: int, i: int) -> None:
        pass


class RefPlanner(_Planner):
    """The planner with its old prefetch pass."""

    def __init__(self, seq: Sequence, budget: int, window: int, policy: str, threshold: int, ahead: int) -> None:
        super().__init__(seq, budget, window, policy, threshold, ahead)
        self.wanted = _Heap(seq)
        self.triggers = self._old_triggers()

    def _old_window_end(self) -> list[int]:
        seq, n, w = self.seq, self.n, self.window
        ends, r, acc = [0] * n, -1, 0
        for i in range(n):
            if r < i:
                r, acc = i, seq.sizes[seq.var[i]]
            while r + 1 < n and acc + seq.sizes[seq.var[r + 1]] <= w:
                r += 1
                acc += seq.sizes[seq.var[r]]
            ends[i] = r
            acc -= seq.sizes[seq.var[i]]
        return ends

    def _old_triggers(self) -> list[list[int]]:
        seq, n = self.seq, self.n
        triggers: list[list[int]] = [[] for _ in range(n)]
        if self.policy == "window":
            self.window_end = self._old_window_end()
            reached = -1
            for i in range(n):
                for u in range(max(reached + 1, i + 1), self.window_end[i] + 1):
                    if seq.kind[u] != SAVE:
                        triggers[i].append(u)
                reached = max(reached, self.window_end[i])
        else:
            for u in range(n):
                if seq.kind[u] != SAVE:
                    triggers[max(0, u - self.ahead)].append(u)
        return triggers

    def _make_room(self, need: int, keep: set[int], forced: bool, wanted: Optional[dict[int, int]] = None) -> bool:
        assert wanted is None
        for v in list(self.pending):
            if self._free() >= need:
                return True
            if v not in keep and self._releasable(v):
                self._do_release(v)
        if self._free() >= need or not forced:
            return self._free() >= need
        victims = sorted(
            (v for v in self.resident if v not in keep and self._releasable(v)), key=lambda v: -self._next_use_of(v)
        )
        for v in victims:
            if self._free() >= need:
                break
            if v not in self.host:
                self.swap_out[self.last_access[v]].append(v)
                self.host.add(v)
            self._do_release(v)
        return self._free() >= need

    def _prefetch(self, keep: set[int]) -> None:
        seq, heap = self.seq, self.wanted.heap
        while heap and heap[0][0] <= self.i:
            heapq.heappop(heap)
        wanted_vars = {w for _, w in heap}
        for _use, w in sorted(heap):
            if not seq.swappable[w]:
                continue
            if w in self.resident:
                self.pending.pop(w, None)
                continue
            if w not in self.host:
                continue
            if not self._make_room(seq.sizes[w], keep | wanted_vars, forced=False):
                break
            self._add(w)
            self.swap_in[self.i].append(w)


def ref_plan(seq: Sequence, budget: int, window: Optional[int] = None, policy: str = "window", *,
             swapout_threshold: int = 2, swapin_ahead: int = 1) -> Schedule:  # fmt: skip
    """``plan`` as it was."""
    validate(budget, window, policy)
    error = diagnose(seq, budget)
    if error is not None:
        raise error
    options = {"swapout_threshold": swapout_threshold, "swapin_ahead": swapin_ahead}
    if policy == "none":
        return _plan_none(seq, budget, window or 0, options)
    return RefPlanner(seq, budget, window or 0, policy, swapout_threshold, swapin_ahead).run(options)


Chosen = tuple[int, Schedule, SimResult]


def ref_choose_window(seq: Sequence, budget: int, h2d_bandwidth: float, d2h_bandwidth: float,
                      candidates: Optional[list[int]] = None,
                      vmm: Optional[Callable[[Schedule], list[float]]] = None) -> Chosen:  # fmt: skip
    """``choose_window`` as it was: every window planned from scratch and simulated with its actions."""
    if candidates is None:
        largest = max(seq.sizes, default=1)
        room = max(largest, budget - max(seq.nonswap, default=0))
        candidates, w = [], largest
        while w < room:
            candidates.append(int(w))
            w *= 1.5
        candidates.append(int(room))
    results = []
    for w in sorted(set(min(c, budget) for c in candidates)):
        sched = ref_plan(seq, budget, w, "window")
        results.append((w, sched, simulate(seq, sched, h2d_bandwidth, d2h_bandwidth, vmm=vmm(sched) if vmm else None)))
    best = min(r[2].step_time for r in results)
    for w, sched, sim in results:
        if sim.step_time <= best * 1.01:
            return w, sched, sim
    raise AssertionError("unreachable")
