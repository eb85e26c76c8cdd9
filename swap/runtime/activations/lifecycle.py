"""The executor's plan lifecycle: profiling, planned, fallen back or declined; what a profiling iteration hands
to the planner, and how a planned iteration learns from what it measured. The executor holds one
``Lifecycle`` and tells it where iterations end (it finds the boundaries: Note [Iteration boundaries]).

Note [Two profiling iterations]
The first iteration is not representative: gradients and optimizer state (momentum, Adam moments) are made
during it, so the memory that is not ours to move is larger in every later iteration. The executor
therefore profiles two iterations, both with the conservative plan, and plans from the element-wise larger
of the two. If the first alone cannot fit the budget, no later one can: ``InfeasibleBudget`` is raised at
once (at the second iteration's first saved tensor), with ``min_budget`` raised by what the optimizer step
added. After the sequence changes, one profiling iteration suffices. Plans are kept by the input's shape,
and an iteration of a shape seen before (or smaller than one seen) reuses a kept plan without profiling
(Note [Plans by input shape] in swap.runtime.activations.plan_book).

Note [Benchmark trials are not the floor]
With ``torch.backends.cudnn.benchmark`` on, the first iteration that meets a convolution's shapes times every
engine, each with its own workspace: gigabytes held for a moment, once, never again for those shapes. Merged
into the plan's memory, that transient became every later step's floor (a budget judged infeasible, or swaps
no run needs). So while trials run (``trials()``), a profile's memory is not carried into the next one: the
later profile, which ran with the engines chosen, stands alone, and the first one is not judged infeasible on
its own (its trials may exceed what any planned step needs). A step that overruns later is learned as any
other (Note [Learning from an overrun]).

Note [Iteration boundaries]
An iteration starts at the first saved tensor after a backward pass has ended (autograd's engine callback,
queued at the first unpack of each backward). So a second backward over a retained graph, several
forwards before one backward, or a forward whose graph is dropped all belong to the iteration they run in,
and the optimizer step is part of the last step's interval. Variables are numbered afresh in save order
each iteration, so a repeated training step reproduces the profiled sequence step for step; the first step
that differs (shape, order) switches the rest of the iteration to the conservative plan and makes the next
one a profiling iteration.

Note [Learning from an overrun]
Planned iterations measure every step. A step that exceeds the budget is warned about at once
(``BudgetWarning``), and at the next iteration's start the plan is remade with the measured memory for
that step: once per step (a step that keeps varying is not re-planned again: no cycle). When the memory
live at an iteration's start grows past what the plan assumed (optimizer state made later, a larger
input), the plan is remade with that growth, before any step can exceed the budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Union

from ...schedule.scheduler import InfeasibleBudget, Schedule
from ...schedule.sequence import Sequence
from ...units import fmt_bytes
from .plan_book import Entry, PlanBook, ShapeKey

log = logging.getLogger("swap")

PROFILE, PLANNED, FALLBACK, DECLINED = "profile", "planned", "fallback", "declined"


class Counters:
    """What the run counted, for the report."""

    def __init__(self) -> None:
        self.iterations = 0
        self.swapped_out_bytes = 0
        self.swapped_in_bytes = 0
        self.demand_fetches = 0
        self.stall_seconds = 0.0
        self.replans = 0
        self.profiling_iterations = 0  # iterations profiled (apart from re-plans, which profile nothing)
        self.evictions = 0
        self.overruns = 0  # steps measured above the budget
        # (iteration, "profile" | "replan" | "refine"), iterations from 0: where the planning work fell (a
        # profile: the iteration profiled; a re-plan or a derived plan's refinement: the iteration it was for)
        self.plan_events: list[tuple[int, str]] = []

    def event(self, kind: str, ended: bool = False) -> None:
        """Planning work of ``kind`` for the iteration running now (``ended``: the one that just ended)."""
        self.plan_events.append((max(0, self.iterations - ended), kind))


@dataclass(frozen=True)
class Reprofile:
    """What the manager's planner returns to profile again before planning: it changed what the model saves
    (recompute regions applied), so the sequence profiled so far no longer holds."""

    iterations: int = 1


@dataclass
class Profiled:
    """What a finished profiling iteration hands to the manager's planner."""

    sequence: Optional[Sequence]  # None: nothing was saved that the manager may move
    final: bool  # the last profiling iteration: plan now (else only judge feasibility)
    growth: int  # memory live at this iteration's start less at the profiled one's
    unswapped_peak: Optional[int]  # what the run reaches without swapping, where it can be measured
    peak: int  # the highest memory the iteration measured
    overruns: list[tuple[int, int]] = field(default_factory=list)  # (step, measured) above the budget
    may_decline: bool = True  # False once a declined run went over the budget: swap from now on
    trials: bool = False  # its memory may hold benchmark trials (Note [Benchmark trials are not the floor])


Planner = Callable[[Profiled], Union[Schedule, Reprofile, None]]
Warn = Callable[[Any, str], None]


class Lifecycle:
    """The plan the executor follows and its mode (``PROFILE``, ``PLANNED``, ``FALLBACK``, ``DECLINED``).

    ``planner`` judges a profile and returns the schedule, a ``Reprofile``, or None to decline (or to go on
    profiling); ``replanner`` remakes the schedule for a changed sequence; ``warn(cause, message)`` gives a
    ``BudgetWarning``; ``unmanaged(peak)`` is told an iteration's peak when it is over the budget and nothing
    is managed (Note [Nothing to move, over the budget] in swap.runtime.notices)."""

    def __init__(self, budget: int, counters: Counters, planner: Planner, replanner: Callable[[Sequence], Schedule],
                 warn: Warn, unmanaged: Callable[[int], None], profile_iterations: int = 2,
                 trials: Callable[[], bool] = lambda: False) -> None:  # fmt: skip
        self.budget = budget
        self.counters = counters
        self.planner = planner
        self.replanner = replanner
        self.warn = warn
        self.unmanaged = unmanaged
        self.trials = trials  # Note [Benchmark trials are not the floor]
        self.mode = PROFILE
        self.profiles_left = profile_iterations
        self.schedule: Optional[Schedule] = None
        self.sequence: Optional[Sequence] = None
        self.previous: Optional[Sequence] = None  # the last profiling iteration's recording
        self.unswapped_peak: Optional[int] = None
        self.allow_decline = True
        self.plan_first_live = 0  # memory live at the start of the iteration the plan was profiled on
        self.learned: set[int] = set()
        self.to_learn: dict[int, int] = {}  # step -> measured nonswap, in this planned iteration
        self.book = PlanBook()
        self.key: Optional[ShapeKey] = None  # this iteration's shape key
        self.bounds = False  # the plan is a larger shape's: its sizes bound a step's bytes
        self.source: Optional[ShapeKey] = None  # the key a derived plan was profiled at (None: its own)

    @property
    def latest(self) -> Optional[Sequence]:
        """The sequence planned on, else the last one profiled."""
        return self.sequence if self.sequence is not None else self.previous

    def reprofile(self, iterations: int = 1) -> None:
        """Profile ``iterations`` more before planning, from scratch."""
        self.mode, self.profiles_left, self.previous = PROFILE, iterations, None

    def diverged(self) -> None:
        """A planned step differs from the plan: the conservative plan until the iteration ends."""
        self.counters.replans += 1
        self.counters.event("replan")
        self.book.reject(self.key, self.bounds)
        self.mode = FALLBACK

    def stays(self, key: ShapeKey) -> bool:
        """A declined run whose next iteration has the same shape key: it stays declined, untouched."""
        return self.mode == DECLINED and key == self.key

    def enter(self, key: ShapeKey, first_live: int) -> None:
        """An iteration of shape ``key`` begins with ``first_live`` bytes live (Note [Plans by input shape]): the
        plan of the one that ended is kept under its key, and this one's is chosen."""
        book, old = self.book, self.key
        book.seen.add(key)
        self.key = key
        if self.mode in (PLANNED, DECLINED) and old is not None:
            book.keep(old, Entry(self.sequence, self.schedule, self.plan_first_live, self.bounds, self.learned,
                                 self.source))  # fmt: skip
            if key == old:
                return
        elif self.mode != PROFILE or not book.entries:
            return  # the first plan is being profiled, or a fallback iteration ran (it re-profiles)
        entry, source = book.find(key)
        if entry is None:  # this shape's own profile
            if self.mode != PROFILE:
                self.reprofile()
            self.unswapped_peak = None
            return
        derived = key not in book.entries
        book.reused += 1
        book.derived += derived
        self.sequence, self.schedule, self.plan_first_live = entry.sequence, entry.schedule, entry.first_live
        self.mode = PLANNED if entry.schedule is not None else DECLINED
        self.bounds, self.learned, self.to_learn = entry.bounds or derived, set(entry.learned), {}
        self.source = source
        if self.mode == PLANNED:
            self.grown(first_live)

    # -- iteration ends ---------------------------------------------------------------------------------
    def profiled(self, seq: Optional[Sequence], profiled_first_live: int, first_live: int, shadow: Optional[int],
                 peak: int, overruns: list[tuple[int, int]]) -> None:  # fmt: skip
        """A profiling iteration ended with ``seq`` recorded (Note [Two profiling iterations]):
        ``profiled_first_live``, the memory live at its first access; ``first_live``, at the next one's."""
        trials = self.trials()
        if seq is not None and self.previous is not None and self.previous.signature() == seq.signature():
            seq = _merge(self.previous, seq, memory=not trials)
        if shadow is not None:  # after a profile with trials, this one's alone
            self.unswapped_peak = shadow if trials and self.previous is not None else max(self.unswapped_peak or 0,
                                                                                           shadow)  # fmt: skip
        self.previous = seq
        self.profiles_left -= 1
        self.counters.profiling_iterations += 1
        self.counters.event("profile", ended=True)
        final = self.profiles_left <= 0
        growth = max(0, first_live - profiled_first_live)
        try:
            schedule = self.planner(
                Profiled(seq, final, growth, self.unswapped_peak, peak, overruns, may_decline=self.allow_decline,
                         trials=trials)
            )
        except InfeasibleBudget:
            self.reprofile()
            raise
        if isinstance(schedule, Reprofile):
            self.reprofile(schedule.iterations)
            self.book.clear()  # what the model saves changed
            self.unswapped_peak = None  # measured without the change: a run with it has its own
            return
        if final:
            self.sequence, self.schedule = seq, schedule
            self.mode = PLANNED if schedule is not None else DECLINED
            self.plan_first_live, self.bounds, self.source = profiled_first_live, False, None
            self.learned, self.to_learn = set(), {}
            if self.mode == PLANNED:
                self.grown(first_live)

    def planned(self, first_live: int, steps: int, sizes: list[int]) -> None:
        """A planned iteration of ``steps`` steps ended, its variables ``sizes`` bytes (Note [Learning from an
        overrun]; a derived plan is re-planned on the sizes: Note [Plans by input shape])."""
        seq = self.sequence
        if steps != len(seq):  # ended early: the sequence changed
            log.info("swap: the iteration ended after %d steps, the plan has %d: re-profiling", steps, len(seq))
            self.counters.replans += 1
            self.counters.event("replan", ended=True)
            self.book.reject(self.key, self.bounds)
            self.reprofile()
            return
        new = {i: b for i, b in self.to_learn.items() if i not in self.learned}
        self.to_learn = {}
        refine = self.bounds and len(sizes) == len(seq.sizes)
        if new or refine:
            nonswap = list(seq.nonswap)
            for i, b in new.items():
                nonswap[i] = max(nonswap[i], b)
            if refine:  # a step over the budget is learned again on the shape's own sizes (resident was bounds)
                seq, self.bounds = replace(seq, sizes=list(sizes)), False
                self.book.refined += 1
            else:
                self.learned |= set(new)
            self.replan(replace(seq, nonswap=nonswap), f"{len(new)} step(s) measured above the plan" if new else "")
        self.grown(first_live)

    def grown(self, first_live: int) -> None:
        """The memory live at the iteration's start grew past what the plan assumed: plan with it."""
        growth = first_live - self.plan_first_live
        if growth > 0 and self.schedule.peak + growth > self.budget:
            self.plan_first_live = first_live
            seq = self.sequence
            why = f"{fmt_bytes(growth)} more was live at the iteration's start than when it was profiled"
            self.replan(replace(seq, nonswap=[b + growth for b in seq.nonswap]), why)

    def replan(self, seq: Sequence, why: str) -> None:
        """Plans ``seq`` again because of ``why`` (a re-plan); ``why`` empty: a derived plan's own sizes."""
        self.counters.replans += bool(why)
        self.counters.event("replan" if why else "refine")
        log.info("swap: re-planning: %s", why or "a larger shape's plan, on this shape's sizes")
        try:
            self.schedule = self.replanner(seq)
        except InfeasibleBudget:
            self.reprofile()
            raise
        self.sequence = seq

    def declined_backward(self, peak: int) -> None:
        """A backward pass of a declined run ended with ``peak`` the highest memory since the last one."""
        if peak > self.budget and self.sequence is None:
            self.unmanaged(peak)  # Note [Nothing to move, over the budget] (swap.runtime.notices)
        elif peak > self.budget and self.allow_decline:
            self.warn(
                "declined-overrun",
                f"the run was not swapped (it fit the budget when profiled), but this iteration reached "
                f"{fmt_bytes(peak)}, over the budget of {fmt_bytes(self.budget)}: profiling again and "
                "swapping from now on",
            )
            self.counters.overruns += 1
            self.allow_decline = False
            self.book.reject(self.key, self.bounds)
            self.reprofile()

    # -- steps over the budget --------------------------------------------------------------------------
    def profile_overrun(self, iteration: int, peak: int, where: str) -> None:
        self.warn(
            ("profile-overrun", iteration),
            f"profiling iteration {iteration} exceeded the budget of {fmt_bytes(self.budget)} by "
            f"{fmt_bytes(peak - self.budget)} ({fmt_bytes(peak)}) {where}. A profiling "
            "iteration holds only the saved tensor each step uses, so what is not swappable there exceeds the "
            "budget (InfeasibleBudget follows at the next iteration's first saved tensor, with the smallest "
            "budget that fits) or grew since the last profile",
        )

    def planned_overrun(self, iteration: int, i: int, peak: int, where: str) -> None:
        """Step ``i`` of a planned iteration measured ``peak``, over the budget: learned for the next one."""
        seq, s = self.sequence, self.schedule
        planned = seq.nonswap[i] + s.resident[i]
        self.to_learn[i] = max(self.to_learn.get(i, 0), peak - s.resident[i])
        again = i in self.learned
        self.warn(
            ("planned-overrun-again" if again else ("planned-overrun", iteration)),
            f"iteration {iteration} exceeded the budget of {fmt_bytes(self.budget)} by "
            f"{fmt_bytes(peak - self.budget)} {where} (planned {fmt_bytes(planned)}, measured "
            f"{fmt_bytes(peak)}): "
            + ("it was re-planned for that already; the memory there varies between iterations"
               if again else "the next iteration is planned with what was measured"),
        )  # fmt: skip


def _merge(a: Sequence, b: Sequence, memory: bool = True) -> Sequence:
    """Two profiles of one sequence: the element-wise larger memory (``memory``; else ``b``'s: Note [Benchmark
    trials are not the floor]), swappable only where both say so."""
    if not memory:
        a = replace(a, nonswap=b.nonswap, transient=b.transient, base=b.base)
    return replace(
        b,
        nonswap=[max(x, y) for x, y in zip(a.nonswap, b.nonswap)],
        swappable=[x and y for x, y in zip(a.swappable, b.swappable)],
        held_until=[max(x, y) for x, y in zip(a.held_until, b.held_until)],
        node_last=[max(x, y) for x, y in zip(a.node_last, b.node_last)],
        freed=[max(x, y) for x, y in zip(a.freed, b.freed)],
        transient=[max(x, y) for x, y in zip(a.transient, b.transient)],
        kept=[max(x, y) for x, y in zip(a.kept, b.kept)],
        base=max(a.base, b.base),
        modules=[x or y for x, y in zip(a.modules, b.modules)],
    )


__all__ = ["Counters", "Lifecycle", "Profiled", "Reprofile", "PROFILE", "PLANNED", "FALLBACK", "DECLINED"]
