"""The executor's iteration lifecycle: where an iteration begins and ends, what a profiling iteration hands to
the planner, and how a planned iteration learns from what it measured.

Note [Two profiling iterations]
The first iteration is not representative: gradients and optimizer state (momentum, Adam moments) are made
during it, so the memory that is not ours to move is larger in every later iteration. The executor
therefore profiles two iterations, both with the conservative plan, and plans from the element-wise larger
of the two. If the first alone cannot fit the budget, no later one can: ``InfeasibleBudget`` is raised at
once (at the second iteration's first saved tensor), with ``min_budget`` raised by what the optimizer step
added. After the sequence changes, one profiling iteration suffices.

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
from typing import Optional

import torch

from ..schedule.scheduler import InfeasibleBudget, Schedule
from ..schedule.sequence import SAVE, Sequence
from ..units import fmt_bytes
from .recorder import Recorder
from .tracer import Variable

log = logging.getLogger("swap")

PROFILE, PLANNED, FALLBACK, DECLINED = "profile", "planned", "fallback", "declined"


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


class Lifecycle:
    """The iteration lifecycle of ``Executor`` (a mixin: it runs on the executor's own state)."""

    mode: str
    schedule: Optional[Schedule]
    sequence: Optional[Sequence]

    def _begin_iteration(self, t: torch.Tensor) -> None:
        """The first saved tensor after a backward: judge the iteration that ended, start the next."""
        peak = self.memory.window_peak()
        shadow = self.memory.shadow_window_peak()
        if self.iteration > 0 and self.step > 0:
            self._close_step(peak, tail=True)
        self._release_leftovers()
        old_vars, recorder, ended = self.vars, self.recorder, self.mode
        steps = self.step
        self.last_actions = self.actions
        self._backward_done, self._iteration_counted = False, False
        self.iteration += 1
        self.recorder = None
        first_live = self.memory.current()
        self._reset_iteration()
        if ended == PROFILE and recorder is not None:
            self._finish_profile(recorder, old_vars, shadow, first_live, peak)
        elif ended == PLANNED:
            self._after_planned(first_live, steps)
        elif ended == FALLBACK:
            self.mode, self.profiles_left, self._previous = PROFILE, 1, None
        if self.mode == PROFILE:
            self.recorder = Recorder(first_live, t.untyped_storage().nbytes())

    def _finish_profile(
        self, rec: Recorder, old_vars: list[Variable], shadow: Optional[int], first_live: int, peak: int
    ) -> None:
        seq = rec.finish([v.nbytes for v in old_vars], [v.module for v in old_vars], self.timer.resolve)
        if seq is not None and self._previous is not None and self._previous.signature() == seq.signature():
            seq = _merge(self._previous, seq)
        self._previous = seq
        if shadow is not None:
            self._unswapped_peak = max(self._unswapped_peak or 0, shadow)
        self.profiles_left -= 1
        final = self.profiles_left <= 0
        growth = max(0, first_live - rec.first_live)
        peak = max([peak] + rec.peak)
        try:
            schedule = self.planner(Profiled(seq, final, growth, self._unswapped_peak, peak, rec.overruns))
        except InfeasibleBudget:
            self.mode, self.profiles_left, self._previous = PROFILE, 1, None
            raise
        if isinstance(schedule, Reprofile):
            self.mode, self.profiles_left, self._previous = PROFILE, schedule.iterations, None
            self._unswapped_peak = None  # measured without the change: a run with it has its own
            return
        if final:
            self.sequence, self.schedule = seq, schedule
            self.mode = PLANNED if schedule is not None else DECLINED
            if seq is None:
                self.allow_decline = False  # nothing to manage (the manager warned): nothing to re-profile for
            self._plan_first_live = rec.first_live
            self._learned, self._to_learn = set(), {}
            if self.mode == PLANNED:
                self._grown(first_live)

    def _after_planned(self, first_live: int, steps: int) -> None:
        seq = self.sequence
        if steps != len(seq):  # ended early: the sequence changed
            log.info("swap: the iteration ended after %d steps, the plan has %d: re-profiling", steps, len(seq))
            self.counters.replans += 1
            self.mode, self.profiles_left, self._previous = PROFILE, 1, None
            return
        new = {i: b for i, b in self._to_learn.items() if i not in self._learned}
        self._to_learn = {}
        if new:
            nonswap = list(seq.nonswap)
            for i, b in new.items():
                nonswap[i] = max(nonswap[i], b)
            self._learned |= set(new)
            self._replan(replace(seq, nonswap=nonswap), f"{len(new)} step(s) measured above the plan")
        self._grown(first_live)

    def _grown(self, first_live: int) -> None:
        """The memory live at the iteration's start grew past what the plan assumed: plan with it."""
        growth = first_live - self._plan_first_live
        if growth > 0 and self.schedule.peak + growth > self.budget:
            self._plan_first_live = first_live
            seq = self.sequence
            why = f"{fmt_bytes(growth)} more was live at the iteration's start than when it was profiled"
            self._replan(replace(seq, nonswap=[b + growth for b in seq.nonswap]), why)

    def _replan(self, seq: Sequence, why: str) -> None:
        self.counters.replans += 1
        log.info("swap: re-planning: %s", why)
        try:
            self.schedule = self.replanner(seq)
        except InfeasibleBudget:
            self.mode, self.profiles_left, self._previous = PROFILE, 1, None
            raise
        self.sequence = seq

    def _backward_end(self) -> None:
        """Autograd finished a backward pass (engine callback)."""
        with self.lock:
            self._in_backward = False
            self._backward_done = True
            self._last_node = None  # the node (and the graph behind it) must not outlive the backward
            if not self._iteration_counted:
                self.counters.iterations += 1
                self._iteration_counted = True
            if self.closed:
                return
            self._process_dying()
            if self.mode in (PROFILE, FALLBACK):
                for v in self.held_vars:  # nothing of ours is held across the optimizer step
                    self._release(v)
                self.held_vars, self.prefetched = [], None
            elif self.mode == DECLINED:
                peak = self.memory.window_peak()
                if peak > self.budget and self.sequence is None:
                    self.unmanaged(peak)  # Note [Nothing to move, over the budget] (manager.py)
                elif peak > self.budget and self.allow_decline:
                    self.warn(
                        "declined-overrun",
                        f"the run was not swapped (it fit the budget when profiled), but this iteration reached "
                        f"{fmt_bytes(peak)}, over the budget of {fmt_bytes(self.budget)}: profiling again and "
                        "swapping from now on",
                    )
                    self.counters.overruns += 1
                    self.allow_decline = False
                    self.mode, self.profiles_left, self._previous = PROFILE, 1, None
            self.engine.measure()

    def _release_leftovers(self) -> None:
        """Variables of the iteration that ended and still on the device leave it (graphs kept alive)."""
        self._process_dying()
        for v in self.vars:
            if v.dev is not None:
                self._release(v)
        self.held_vars, self.prefetched = [], None

    def _close_step(self, peak: int, tail: bool = False) -> None:
        """The interval after the previous access ended with ``peak`` the highest memory in it (``tail``: the
        iteration's last interval, through the optimizer step)."""
        i = self.step - 2 if self._in_hook else self.step - 1  # the step whose interval this was
        rec = self.recorder
        if rec is not None:
            rec.close_step(peak, self.memory.held_window_peak(), self.timer.stop())
        if peak <= self.budget:
            return
        self.counters.overruns += 1
        if rec is not None:
            rec.overruns.append((i, peak))
            self.warn(
                ("profile-overrun", self.iteration),
                f"profiling iteration {self.iteration} exceeded the budget of {fmt_bytes(self.budget)} by "
                f"{fmt_bytes(peak - self.budget)} ({fmt_bytes(peak)}) {self._where(i, tail, rec)}. A profiling "
                "iteration holds only the saved tensor each step uses, so what is not swappable there exceeds the "
                "budget (InfeasibleBudget follows at the next iteration's first saved tensor, with the smallest "
                "budget that fits) or grew since the last profile",
            )
        elif self.mode == PLANNED and i < len(self.sequence):
            seq, s = self.sequence, self.schedule
            planned = seq.nonswap[i] + s.resident[i]
            self._to_learn[i] = max(self._to_learn.get(i, 0), peak - s.resident[i])
            again = i in self._learned
            self.warn(
                ("planned-overrun-again" if again else ("planned-overrun", self.iteration)),
                f"iteration {self.iteration} exceeded the budget of {fmt_bytes(self.budget)} by "
                f"{fmt_bytes(peak - self.budget)} {self._where(i, tail)} (planned {fmt_bytes(planned)}, measured "
                f"{fmt_bytes(peak)}): "
                + ("it was re-planned for that already; the memory there varies between iterations"
                   if again else "the next iteration is planned with what was measured"),
            )  # fmt: skip

    def _where(self, i: int, tail: bool, rec: Optional[Recorder] = None) -> str:
        var_ids, kinds = (rec.var, rec.kind) if rec is not None else (self.sequence.var, self.sequence.kind)
        if i >= len(var_ids):
            return "after the last saved tensor"
        v = var_ids[i]
        module = self.vars[v].module if v < len(self.vars) else ""
        if not module and self.sequence is not None and self.sequence.modules and v < len(self.sequence.modules):
            module = self.sequence.modules[v]
        phase = "forward" if kinds[i] == SAVE else "backward"
        if tail:
            return f"after the backward of {module or 'the model'} (the rest of backward, the optimizer step)"
        return f"in the {phase} of {module or 'the model'}"


def _merge(a: Sequence, b: Sequence) -> Sequence:
    """Two profiles of one sequence: the element-wise larger memory, swappable only where both say so."""
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


__all__ = ["Lifecycle", "Profiled", "Reprofile", "PROFILE", "PLANNED", "FALLBACK", "DECLINED"]
