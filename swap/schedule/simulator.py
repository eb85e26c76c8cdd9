"""A discrete-event simulator of a schedule: one compute stream and independent H2D and D2H copy engines.

It replays exactly the actions the executor issues, in the same order (``Schedule.actions``): at step i the
compute stream waits for the D2H copies of ``release[i]``, spends ``vmm[i]`` seconds of host time in the
allocator's driver calls, queues the H2D copies of ``swap_in[i]``, waits for the H2D copy of the variable it
uses, queues the D2H copies of ``swap_out[i]``, then computes for ``compute[i]`` seconds. Copies on one
engine run one after another at the link's bandwidth. A clean variable (Note [Clean variables] in
swap/schedule/sequence.py) has no D2H copy: leaving the device costs it nothing.

Note [Where VMM work is charged]
vmalloc's cuMemMap/cuMemSetAccess/cuMemUnmap calls are synchronous host work: while the allocator maps, the
host issues nothing, so neither kernels nor the copies of that step start (the H2D copies of a step need
their device memory first). Unmapping first waits for the events of the frees it reclaims (the fence); in
this simulator every such event has passed by then (a released variable's D2H copy was already waited for,
and frees on the compute stream precede the host's issue point), so the wait costs nothing beyond the host
time. ``vmm[i]`` is therefore charged on the compute stream, before step i's copies are queued; the work of
a step is measured by replaying the swapped trace through the allocator (bench.vmm_work).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

from .scheduler import Schedule, plan, plan_windows
from .sequence import Sequence


@dataclass
class SimResult:
    step_time: float  # seconds for the iteration
    compute_time: float
    stall_time: float
    stalls: list[float]  # per step: compute-stream seconds spent waiting for copies
    h2d_bytes: int
    d2h_bytes: int
    lower_bound: float  # max(compute, H2D bytes / bandwidth, D2H bytes / bandwidth, VMM host time)
    peak_bytes: int  # planned device peak (non-swappable + resident)
    memory: list[int]  # device bytes during each step
    actions: list[tuple[int, str, int]]
    timeline: list[tuple[str, float, float, str]] = field(default_factory=list)  # (lane, start, end, label)
    vmm_time: float = 0.0  # host seconds in the allocator's driver calls (on the compute stream)
    link_stall: float = 0.0  # stall seconds while a copy engine was busy the whole wait (the link binds)

    @property
    def overhead(self) -> float:
        """Step time over the lower bound (1.0 = every copy hidden)."""
        return self.step_time / self.lower_bound if self.lower_bound else 1.0


def simulate(
    seq: Sequence,
    schedule: Schedule,
    h2d_bandwidth: float,
    d2h_bandwidth: float,
    timeline: bool = False,
    vmm: Optional[list[float]] = None,
    actions: bool = True,
) -> SimResult:
    """Replays ``schedule`` on ``seq`` with links of the given bandwidths (bytes/second); ``vmm``: host seconds
    of allocator driver calls per step (Note [Where VMM work is charged]); ``actions=False`` leaves
    ``SimResult.actions`` empty (a sweep that keeps one result lists its actions only)."""
    if h2d_bandwidth <= 0 or d2h_bandwidth <= 0:
        raise ValueError("bandwidths must be positive (bytes per second)")
    if vmm is not None and len(vmm) != len(seq):
        raise ValueError(f"vmm must have one entry per step ({len(seq)}), not {len(vmm)}")
    t = 0.0
    h2d_free = d2h_free = 0.0
    h2d_done: dict[int, float] = {}
    d2h_done: dict[int, float] = {}
    queued: dict[tuple[str, int], float] = {}  # (lane, variable) -> seconds its copy waited behind others
    stalls = [0.0] * len(seq)
    link_stall = 0.0
    lanes: list[tuple[str, float, float, str]] = []
    h2d_bytes = d2h_bytes = 0
    issued = schedule.actions(seq) if actions else []

    def wait(until: float, i: int, lane: str = "", v: int = -1) -> None:
        """The compute stream waits until ``until`` for variable v's copy on ``lane``. The part of the wait
        that the copy spent queued behind other copies is link-bound (the link, not the plan, was late)."""
        nonlocal t, link_stall
        if until > t:
            stalls[i] += until - t
            link_stall += min(until - t, queued.get((lane, v), 0.0))
            if timeline:
                lanes.append(("stall", t, until, f"step {i}"))
            t = until

    def copy(v: int, lane_free: float, bandwidth: float, lane: str) -> float:
        """Queues variable v's copy on a lane that is free from ``lane_free``; returns when it is done."""
        start = max(t, lane_free)
        end = start + seq.sizes[v] / bandwidth
        queued[(lane, v)] = start - t
        if timeline:
            lanes.append((lane, start, end, f"v{v}"))
        return end

    vmm_time = 0.0
    for i in range(len(seq)):
        for v in schedule.release[i]:
            wait(d2h_done.get(v, 0.0), i, "d2h", v)
        if vmm and vmm[i] > 0:
            if timeline:
                lanes.append(("vmm", t, t + vmm[i], f"step {i}"))
            t += vmm[i]
            vmm_time += vmm[i]
        for v in schedule.swap_in[i]:
            h2d_free = h2d_done[v] = copy(v, h2d_free, h2d_bandwidth, "h2d")
            h2d_bytes += seq.sizes[v]
        if seq.kind[i] != "save":
            wait(h2d_done.get(seq.var[i], 0.0), i, "h2d", seq.var[i])
        for v in schedule.swap_out[i]:
            if seq.clean[v]:  # its host copy is valid: nothing to copy, nothing to wait for
                continue
            d2h_free = d2h_done[v] = copy(v, d2h_free, d2h_bandwidth, "d2h")
            d2h_bytes += seq.sizes[v]
        if timeline and seq.compute[i] > 0:
            lanes.append(("compute", t, t + seq.compute[i], f"step {i}"))
        t += seq.compute[i]
    compute = sum(seq.compute)
    lower = max(compute, h2d_bytes / h2d_bandwidth, d2h_bytes / d2h_bandwidth, vmm_time)
    memory = [a + b for a, b in zip(seq.nonswap, schedule.resident)]
    return SimResult(
        t, compute, sum(stalls), stalls, h2d_bytes, d2h_bytes, lower, schedule.peak, memory, issued, lanes,
        vmm_time, link_stall,
    )  # fmt: skip


def choose_window(
    seq: Sequence,
    budget: int,
    h2d_bandwidth: float,
    d2h_bandwidth: float,
    candidates: Optional[list[int]] = None,
    vmm: Optional[Callable[[Schedule], list[float]]] = None,
) -> tuple[int, Schedule, SimResult]:
    """``window="auto"``: the window whose simulated iteration is fastest on the measured link and compute
    times; among windows within 1% of the fastest, the smallest (it holds the least memory ahead). ``vmm``, if
    given, returns a schedule's allocator host seconds per step, which are then counted in the choice."""
    if candidates is None:
        largest = max(1, max(seq.sizes, default=1))  # a sequence of empty variables: still one window
        room = max(largest, budget - max(seq.nonswap, default=0))
        candidates, w = [], largest
        while w < room:
            candidates.append(int(w))
            w *= 1.5
        candidates.append(int(room))
    floor = _step_time_floor(seq)
    results: list[tuple[int, Schedule, SimResult]] = []
    for w, sched in plan_windows(seq, budget, sorted(set(min(c, budget) for c in candidates))):
        sim = simulate(seq, sched, h2d_bandwidth, d2h_bandwidth, vmm=vmm(sched) if vmm else None, actions=False)
        results.append((w, sched, sim))
        if _settled(results, floor) is not None:  # Note [Windows left unplanned]
            break
    pick = _settled(results, floor)
    if pick is None:
        best = min(r[2].step_time for r in results)
        pick = next(k for k, r in enumerate(results) if r[2].step_time <= best * 1.01)
    w, sched, sim = results[pick]
    sim.actions = sched.actions(seq)
    return w, sched, sim


def _step_time_floor(seq: Sequence) -> float:
    """A float no simulated step time of ``seq`` is below: its compute seconds added in step order, as
    ``simulate`` adds them (Note [Windows left unplanned])."""
    t = 0.0
    for c in seq.compute:
        t += c
    return t


def _settled(results: list[tuple[int, Schedule, SimResult]], floor: float) -> Optional[int]:
    """Which of ``results`` (windows in increasing order) ``choose_window`` takes whatever the windows after them
    simulate, if that is already known (Note [Windows left unplanned]); else None.

    Note [Windows left unplanned]
    ``choose_window`` takes the first window within 1% of the fastest. No window's simulated step is faster
    than ``floor``: ``simulate`` adds each step's compute seconds to a clock that waits and driver calls only
    move on, and a float sum rounds monotonically, so the clock never falls behind the same sum without them.
    So a window within 1% of ``floor`` is within 1% of the fastest, however fast the later ones are; and a
    window slower than 1% over the fastest so far is slower than 1% over the fastest of all. Once every window
    before the first of the former kind is of the latter kind, that window is the choice, and the larger
    windows are neither planned nor simulated. Where copies hide behind compute this ends the sweep early; the
    choice is the one the full sweep makes (tests/swap/test_scheduler_equivalence.py)."""
    fastest = min(r[2].step_time for r in results)
    for k, (_, _, sim) in enumerate(results):
        if sim.step_time <= floor * 1.01:
            return k
        if sim.step_time <= fastest * 1.01:  # it may yet be within 1% of the fastest of all
            return None
    return None


class Scheduled(NamedTuple):
    """A policy's schedule for one sequence and budget (``schedule_for``), and its simulated iteration."""

    window: Optional[int]  # the window policy's look-ahead in bytes, as given or chosen; else as given
    schedule: Schedule
    sim: SimResult


def schedule_for(
    seq: Sequence,
    budget: int,
    policy: str,
    h2d_bandwidth: float,
    d2h_bandwidth: float,
    *,
    window: Optional[int] = None,
    vmm: Optional[Callable[[Schedule], list[float]]] = None,
    swapout_threshold: int = 2,
    swapin_ahead: int = 1,
) -> Scheduled:
    """The schedule ``policy`` keeps ``budget`` with, and its simulated iteration on the given link: the one
    place that says how a policy gets its schedule. The window policy without a window takes the one
    ``choose_window`` finds fastest (``window="auto"``); any other policy, or a given window, is the
    scheduler's ``plan``. ``vmm`` as in ``choose_window``. Raises ``InfeasibleBudget`` when no schedule fits."""
    if policy == "window" and window is None:
        return Scheduled(*choose_window(seq, budget, h2d_bandwidth, d2h_bandwidth, vmm=vmm))
    sched = plan(seq, budget, window, policy, swapout_threshold=swapout_threshold, swapin_ahead=swapin_ahead)
    sim = simulate(seq, sched, h2d_bandwidth, d2h_bandwidth, vmm=vmm(sched) if vmm else None)
    return Scheduled(window, sched, sim)
