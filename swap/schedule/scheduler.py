"""The scheduler: ``plan(sequence, budget, window, policy) -> Schedule``. Pure: no torch, no CUDA, no I/O.

Policies decide *which* variables leave the device after an access and *when* they are fetched back:

- ``window`` (Section 3 of the window-scheduling paper, arXiv 2010.14109): at step i the window covers the accesses i..r
  whose bytes sum to at most ``window``. A variable whose next access lies outside the next window has its swap-out
  *reserved* (its D2H copy starts); one whose next access is inside stays. Uses entering the window are swapped in.
  Reserved swap-outs are *completed* (device memory dropped) only when room is needed, oldest first, so a
  variable that was never needed out comes back for free.
- ``fixed_distance`` (TFLMS): swap out when the next access is at least ``swapout_threshold`` steps away,
  release as soon as the copy is done (the next step); swap in ``swapin_ahead`` steps before the use.
- ``all`` (vDNN): every variable not used at the very next step goes out and is released at the next step;
  prefetch one step ahead.
- ``none``: nothing moves.

Whatever the policy, one budget guard runs at every step: if the device would exceed the budget, reserved
swap-outs are completed oldest first, then resident variables are evicted farthest-next-use first (their
copy is started after their last access, in hindsight: the plan is made offline), and prefetches that still
do not fit wait. A plan therefore never exceeds the budget; when the step's own working set (the memory
that is not ours plus the variable it touches) exceeds it, no plan can, and ``InfeasibleBudget`` says which
step and by how much (``swap.schedule.budget``: the largest failing step, its module, and what would help).

Note [Copies nothing needs]
A reserved swap-out starts its copy to host when the variable is reserved, so that dropping it later, when
room is needed, waits for nothing. With room to spare most reservations are never completed: the variable
stays until its use, and its copy was traffic on the link, host memory and, on a CPU, the step's own time,
for nothing. A plan is made offline and knows which drops happen, so it keeps only the copies of variables
it drops; more budget then moves fewer bytes. A drop the plan did not make (the allocator's OOM handler, a
step that diverges from the plan) copies first, as it always did for a variable with no host copy.

Clean variables (Note [Clean variables] in swap/schedule/sequence.py) start on the host: every policy fetches
them ahead of their uses like any swapped-out variable, and they leave the device with no copy out.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Optional

from ..units import fmt_bytes
from .budget import InfeasibleBudget, diagnose
from .sequence import SAVE, Sequence
from .wanted import Wanted

POLICIES = ("window", "fixed_distance", "all", "none")


_fmt = fmt_bytes


@dataclass
class Schedule:
    """Actions per step, in the order the executor issues them at step i:
    ``release[i]`` (wait for the D2H copy, drop the device copy), ``swap_in[i]`` (start H2D), the access,
    then ``swap_out[i]`` (start D2H)."""

    policy: str
    budget: int
    window: int
    swap_out: list[list[int]]
    release: list[list[int]]
    swap_in: list[list[int]]
    resident: list[int]  # swappable bytes on the device during each step
    peak: int  # max over steps of nonswap + resident
    options: dict = field(default_factory=dict)

    def actions(self, seq: Sequence) -> list[tuple[int, str, int]]:
        """(step, action, variable) in issue order; action is release, swap_in, access or swap_out."""
        out: list[tuple[int, str, int]] = []
        for i in range(len(seq)):
            out += [(i, "release", v) for v in self.release[i]]
            out += [(i, "swap_in", v) for v in self.swap_in[i]]
            out.append((i, "access", seq.var[i]))
            out += [(i, "swap_out", v) for v in self.swap_out[i]]
        return out

    def bytes_out(self, seq: Sequence) -> int:
        return sum(seq.sizes[v] for step in self.swap_out for v in step)

    def bytes_in(self, seq: Sequence) -> int:
        return sum(seq.sizes[v] for step in self.swap_in for v in step)


def validate(budget: int, window: Optional[int], policy: str) -> None:
    """Fail fast, with what to change, on arguments no plan could use."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: choose one of {', '.join(POLICIES)}")
    if budget <= 0:
        raise ValueError(f"the budget must be positive, not {budget}")
    if window is not None:
        if window <= 0:
            raise ValueError(f"the window must be positive, not {window}")
        if window > budget:
            raise ValueError(
                f"the window ({_fmt(window)}) is larger than the budget ({_fmt(budget)}): a window is the bytes "
                "fetched ahead, which must fit on the device; pass a smaller window or window='auto'"
            )


def plan(
    seq: Sequence,
    budget: int,
    window: Optional[int] = None,
    policy: str = "window",
    *,
    swapout_threshold: int = 2,
    swapin_ahead: int = 1,
) -> Schedule:
    """Plans the swaps of one iteration. ``window`` (bytes) is required by the window policy."""
    if policy == "window" and window is None:
        raise ValueError("the window policy needs a window in bytes (or use swap.choose_window)")
    validate(budget, window, policy)
    if swapout_threshold < 1 or swapin_ahead < 1:
        raise ValueError("swapout_threshold and swapin_ahead must be at least 1 step")
    error = diagnose(seq, budget)
    if error is not None:
        raise error
    options = {"swapout_threshold": swapout_threshold, "swapin_ahead": swapin_ahead}
    if policy == "none":
        return _plan_none(seq, budget, window or 0, options)
    return _Planner(seq, budget, window or 0, policy, swapout_threshold, swapin_ahead).run(options)


def plan_windows(seq: Sequence, budget: int, windows: list[int]) -> Iterator[tuple[int, Schedule]]:
    """``plan(seq, budget, w, "window")`` for each window w, in the order given, as they are asked for, leaving
    out a window whose plan is an earlier one's (Note [Windows with the same plan]). Raises as ``plan`` would
    at the first window that fails."""
    facts: Optional[_Facts] = None
    seen: set[tuple[int, ...]] = set()
    for w in windows:
        validate(budget, w, "window")
        if facts is None:  # the budget check is the same for every window: once
            error = diagnose(seq, budget)
            if error is not None:
                raise error
            facts = _Facts(seq)
        ends = tuple(window_ends(seq, w))
        if ends in seen:
            continue
        seen.add(ends)
        planner = _Planner(seq, budget, w, "window", 2, 1, facts, list(ends))
        yield w, planner.run({"swapout_threshold": 2, "swapin_ahead": 1})


def window_ends(seq: Sequence, window: int) -> list[int]:
    """r_i: the last step of the window of ``window`` bytes that starts at step i.

    Note [Windows with the same plan]
    The window policy sees its window only through these ends (which uses are due, and which variables want
    out), so two windows with the same ends plan the same schedule, but for the ``window`` it records; their
    simulated iterations are the same, and ``choose_window``, which takes the first of the fastest, never takes
    the later one. ``plan_windows`` plans it once."""
    sizes, var, n = seq.sizes, seq.var, len(seq)
    ends, r, acc = [0] * n, -1, 0
    for i in range(n):
        if r < i:
            r, acc = i, sizes[var[i]]
        while r + 1 < n and acc + sizes[var[r + 1]] <= window:
            r += 1
            acc += sizes[var[r]]
        ends[i] = r
        acc -= sizes[var[i]]
    return ends


class _Facts:
    """What every plan of one sequence needs, whatever its window: computed once for a sweep of windows."""

    def __init__(self, seq: Sequence) -> None:
        self.next = seq.next_access()
        self.ends = seq.ends()
        self.first: dict[int, int] = {}  # var -> its first access
        for i, v in enumerate(seq.var):
            self.first.setdefault(v, i)


def _plan_none(seq: Sequence, budget: int, window: int, options: dict) -> Schedule:
    live = seq.live_bytes()
    totals = [a + b for a, b in zip(seq.nonswap, live)]
    if totals and max(totals) > budget:
        i = totals.index(max(totals))
        raise InfeasibleBudget(i, totals[i], budget, "policy 'none' keeps every saved tensor on the device")
    empty: list[list[int]] = [[] for _ in range(len(seq))]
    swap_in: list[list[int]] = [[] for _ in seq.var]
    fetched: set[int] = set()
    for i, v in enumerate(seq.var):  # a clean variable comes from the host at its first use, then stays
        if seq.clean[v] and seq.swappable[v] and v not in fetched:
            fetched.add(v)
            if seq.kind[i] != SAVE:
                swap_in[i].append(v)
    return Schedule(
        "none",
        budget,
        window,
        empty,
        [[] for _ in seq.var],
        swap_in,
        live,
        max(totals, default=0),
        options,
    )


class _Planner:
    def __init__(self, seq: Sequence, budget: int, window: int, policy: str, threshold: int, ahead: int,
                 facts: Optional[_Facts] = None, ends: Optional[list[int]] = None) -> None:  # fmt: skip
        facts = facts or _Facts(seq)
        self.seq, self.budget, self.window, self.policy = seq, budget, window, policy
        self.threshold, self.ahead = threshold, ahead
        self.n = len(seq)
        self.next = facts.next
        self.ends = facts.ends
        self.window_end = ends if ends is not None else window_ends(seq, window) if policy == "window" else []
        n = self.n
        self.swap_out: list[list[int]] = [[] for _ in range(n)]
        self.release: list[list[int]] = [[] for _ in range(n)]
        self.swap_in: list[list[int]] = [[] for _ in range(n)]
        self.resident_trace: list[int] = [0] * n
        self.resident: dict[int, int] = {}  # var -> bytes, on the device
        self.resident_bytes = 0
        # vars with a host copy (made or being made); clean ones have theirs from the start
        self.host: set[int] = {v for v, c in enumerate(seq.clean) if c}
        self.pending: OrderedDict[int, int] = OrderedDict()  # reserved swap-outs still resident, oldest first
        self.eager: list[list[int]] = [[] for _ in range(n + 1)]  # releases due at a step (all/fixed)
        self.last_access: dict[int, int] = {}
        self.first = facts.first
        self.pinned: dict[int, int] = {}  # var -> first step its node no longer holds it
        self.wanted = Wanted(seq)  # the uses to prefetch (Note [An incremental prefetch queue])
        self.i = 0
        self.triggers = self._prefetch_triggers()

    # -- which uses get prefetched, and from which step ----------------------------------------------------
    def _prefetch_triggers(self) -> list[list[int]]:
        """For each step, the use steps whose prefetch becomes due there."""
        seq, n = self.seq, self.n
        triggers: list[list[int]] = [[] for _ in range(n)]
        if self.policy == "window":
            reached, kind, ends = -1, seq.kind, self.window_end
            for i in range(n):
                end = ends[i]
                if end > reached:
                    triggers[i] = [u for u in range(max(reached + 1, i + 1), end + 1) if kind[u] != SAVE]
                    reached = end
        else:
            ahead = self.ahead
            for u in range(n):
                if seq.kind[u] != SAVE:
                    triggers[max(0, u - ahead)].append(u)
        return triggers

    def _wants_out(self, i: int) -> bool:
        nxt = self.next[i]
        if self.policy == "window":
            return i + 1 < self.n and nxt > self.window_end[i + 1]
        if self.policy == "fixed_distance":
            return nxt - i >= self.threshold
        return nxt > i + 1  # all

    # -- state changes ----------------------------------------------------------------------------------
    def _free(self) -> int:
        return self.budget - self.seq.nonswap[self.i] - self.resident_bytes

    def _add(self, v: int) -> None:
        self.resident[v] = self.seq.sizes[v]
        self.resident_bytes += self.seq.sizes[v]

    def _drop(self, v: int) -> None:
        self.resident_bytes -= self.resident.pop(v)
        self.pending.pop(v, None)
        if v in self.host:
            self.wanted.dropped(v, self.i)

    def _do_release(self, v: int) -> None:
        self.release[self.i].append(v)
        self._drop(v)

    def _releasable(self, v: int) -> bool:
        return self.seq.held_until[v] <= self.i and self.pinned.get(v, 0) <= self.i

    def _free_from(self, v: int) -> int:
        """The first step at which releasing v frees its memory."""
        return max(self.seq.held_until[v], self.pinned.get(v, 0))

    def _make_room(self, need: int, keep: set[int], forced: bool, wanted: Optional[dict[int, int]] = None) -> bool:
        """Releases reserved swap-outs oldest first (and, if forced, any resident variable farthest next use
        first) until ``need`` bytes are free. Variables in ``keep`` or ``wanted``, and those the forward still
        holds (``held_until``), stay."""
        if self._free() >= need:
            return True
        wanted = wanted or {}
        for v in list(self.pending):
            if self._free() >= need:
                return True
            if v not in keep and v not in wanted and self._releasable(v):
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
                # In hindsight: start its copy after its most recent access.
                self.swap_out[self.last_access[v]].append(v)
                self.host.add(v)
            self._do_release(v)
        return self._free() >= need

    def _next_use_of(self, v: int) -> int:
        if v not in self.last_access:  # a clean variable fetched ahead of its first access
            return self.first[v]
        return self.next[self.last_access[v]]

    def run(self, options: dict) -> Schedule:
        seq = self.seq
        dies: list[list[int]] = [[] for _ in range(self.n + 1)]
        for i in range(self.n):
            self.i = i
            for v in dies[i]:
                if v in self.resident:
                    self._drop(v)
            for v in self.eager[i]:
                if v in self.resident and v in self.pending:
                    if self._releasable(v):
                        self._do_release(v)
                    elif self._free_from(v) < self.n:
                        self.eager[self._free_from(v)].append(v)  # as soon as the forward (or node) lets go
            for u in self.triggers[i]:
                self.wanted.trigger(u, self.pending)
            v, size = seq.var[i], seq.sizes[seq.var[i]]
            # The access: its variable must be on the device.
            # Room for it, and for whatever the step's non-swappable memory took since the last step.
            need = size if seq.swappable[v] and v not in self.resident else 0
            if not self._make_room(need, {v}, forced=True):  # step_floors rules this out; kept as a guard
                held = sum(b for u, b in self.resident.items() if u != v and not self._releasable(u))
                raise InfeasibleBudget(
                    i, seq.nonswap[i] + held + size, self.budget,
                    f"the forward pass still holds {_fmt(held)} of saved tensors there, with "
                    f"{_fmt(seq.nonswap[i])} that is not swappable",
                )  # fmt: skip
            if seq.swappable[v] and v not in self.resident:
                self._add(v)
                if seq.kind[i] != SAVE:
                    self.swap_in[i].append(v)  # the plan missed it: fetched at the use
            self.pending.pop(v, None)  # accessed now: any reserved swap-out is void
            self.last_access[v] = i
            if seq.kind[i] != SAVE and seq.node_last[i] > i:
                self.pinned[v] = seq.node_last[i] + 1  # the node holds it until it has run
            self._prefetch(keep={v})
            self.resident_trace[i] = self.resident_bytes
            # After the access: does v leave? After its last access it is gone at ``ends[v]``; until then
            # (a graph that outlives its use) it must leave like any other variable.
            last = self.next[i] >= self.n
            if last:
                dies[max(i + 1, self.ends[v])].append(v)
            lingers = last and self.ends[v] > i + 1
            if seq.swappable[v] and (lingers or not last and self._wants_out(i)):
                if v not in self.host:
                    self.swap_out[i].append(v)
                    self.host.add(v)
                self.pending[v] = i
                self.wanted.reserved(v, i)
                if self.policy != "window":
                    self.eager[i + 1].append(v)
        peak = max((a + b for a, b in zip(seq.nonswap, self.resident_trace)), default=0)
        dropped = {v for step in self.release for v in step}  # Note [Copies nothing needs]
        return Schedule(
            self.policy,
            self.budget,
            self.window,
            [[v for v in step if v in dropped] for step in self.swap_out],
            self.release,
            self.swap_in,
            self.resident_trace,
            peak,
            options,
        )

    def _prefetch(self, keep: set[int]) -> None:
        """Swap in wanted uses, nearest first, while room can be made by completing reserved swap-outs.

        A wanted variable that is on the device has its reserved swap-out cancelled (it is needed soon);
        one that does not exist yet, or has no host copy, waits; the first that does not fit stops the
        pass (nearer uses go first), and is tried again at the next step. Only the uses that can act are
        visited (Note [An incremental prefetch queue])."""
        i, var, sizes, wanted = self.i, self.seq.var, self.seq.sizes, self.wanted
        wanted.expire(i)
        fetchable, resident, host = wanted.fetchable, self.resident, self.host
        stop = self.n
        while fetchable:
            u = fetchable[0]
            w = var[u]
            if u <= i or w in resident or w not in host:  # reached, or stale: a later drop pushes it again
                heapq.heappop(fetchable)
                continue
            if not self._make_room(sizes[w], keep, forced=False, wanted=wanted.count):
                stop = u
                break
            heapq.heappop(fetchable)
            self._add(w)
            self.swap_in[i].append(w)
        cancellable = wanted.cancellable
        while cancellable and cancellable[0] < stop:
            u = heapq.heappop(cancellable)
            if u > i:
                self.pending.pop(var[u], None)
