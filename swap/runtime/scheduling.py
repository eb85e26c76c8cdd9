"""What the manager does with a profiled iteration: raise if no plan can fit, warn if it cannot help, decline
when the run fits, ask the joint runtime (``strategy="auto"``) and apply what it decides, and schedule the swaps.
The executor's lifecycle calls ``profiled`` (its planner) and ``schedule`` (its replanner)."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Optional, Union

from ..schedule.budget import diagnose
from ..schedule.scheduler import Schedule
from ..schedule.sequence import Sequence
from ..schedule.simulator import schedule_for
from ..units import fmt_bytes
from .activations.hooks import SavedTensorHooks
from .activations.lifecycle import Profiled, Reprofile
from .auto.joint import JointDecision, JointRuntime
from .auto.ranks import Ranks, agree
from .notices import NO_RECOMPUTE_PLAN, Notices

log = logging.getLogger("swap")

DEFAULT_BANDWIDTH = 10e9  # bytes/s, until copies have been measured


class Scheduling:
    """Plans for ``budget`` with ``policy`` (``window``: bytes, None to choose it; ``swapout_threshold`` and
    ``swapin_ahead`` for "fixed_distance"), at the link rates ``engine`` measured. ``joint`` is the joint
    runtime of ``strategy="auto"`` (None otherwise), ``ranks`` the process group whose ranks choose its plan
    together (None: alone); ``hooks`` say what was left alone; ``notices`` take the notes
    and warnings. ``window_used`` is the window the last schedule was made with."""

    def __init__(
        self, budget: int, window: Optional[int], policy: str, swapout_threshold: int, swapin_ahead: int,
        engine: Any, hooks: SavedTensorHooks, notices: Notices, joint: Optional[JointRuntime],
        ranks: Optional[Ranks] = None,
    ) -> None:  # fmt: skip
        self.budget = budget
        self.window = window
        self.policy = policy
        self.swapout_threshold = swapout_threshold
        self.swapin_ahead = swapin_ahead
        self.engine = engine
        self.hooks = hooks
        self.notices = notices
        self.joint = joint
        self.ranks = ranks
        self.window_used = window

    def rates(self) -> tuple[float, float]:
        """The link's measured (H2D, D2H) bytes per second."""
        return self.engine.h2d_bw.rate(DEFAULT_BANDWIDTH), self.engine.d2h_bw.rate(DEFAULT_BANDWIDTH)

    def unmanaged(self, peak: int) -> None:
        """A declined iteration with nothing to manage reached ``peak`` (Note [Nothing to move, over the budget])."""
        self._nothing_to_move(None, peak)

    def _nothing_to_move(self, seq: Optional[Sequence], peak: int) -> None:
        """Note [Nothing to move, over the budget]; with ``strategy="auto"``, the report's recompute line says
        why no recompute was planned either."""
        joint = self.joint
        if self.notices.nothing_to_move(self.hooks, self.budget, seq, peak, joint is not None) and joint is not None:
            joint.why_none = NO_RECOMPUTE_PLAN

    def profiled(self, p: Profiled) -> Union[Schedule, Reprofile, None]:
        """A profiling iteration ended: raise if no plan can fit, warn if the manager cannot help, and (after
        the last one) decline or plan."""
        seq = p.sequence
        self.hooks.end_profile()  # the next iteration counts afresh
        self._nothing_to_move(seq, max(p.peak, p.unswapped_peak or 0))
        joint = self.joint
        if seq is None:
            if p.final and joint is not None:  # nothing to plan: the operator profiler must not tax every later step
                if not joint.decided and self.ranks is not None:  # the other ranks decide: join them
                    agree(self.ranks, None, None)
                    joint.decided = True
                joint.profiling_done()
            return None
        undecided = joint is not None and not joint.decided  # recompute may still fit what swapping cannot
        if not p.final:
            # Note [Two profiling iterations]: certain already, unless the memory held benchmark trials
            if not p.trials and diagnose(seq, self.budget) is not None:
                grown, note = seq, "Measured in the first iteration"
                if p.growth:
                    grown = replace(seq, nonswap=[b + p.growth for b in seq.nonswap[:-1]] + seq.nonswap[-1:],
                                    base=seq.base + p.growth)
                    note += (f", plus the {fmt_bytes(p.growth)} live from the second on (optimizer state, "
                             "gradients): every step needs it too")  # fmt: skip
                if not undecided or not joint.may_fit(grown, self.budget):
                    raise diagnose(grown, self.budget, note)
            return None
        error = diagnose(seq, self.budget)
        if error is not None and not undecided:
            raise error
        need = p.unswapped_peak if p.unswapped_peak is not None else seq.no_swap_peak()
        # With recompute regions applied, the swaps are planned on what was measured with them, even if none is
        # needed: the peak a run without swapping would reach is measured for the saved-tensor hooks' tensors,
        # not for the ones a checkpoint's frame holds (Note [Applying a joint plan]).
        applied = joint is not None and joint.applied
        declines = error is None and need <= self.budget and p.may_decline and not applied
        if undecided and self.ranks is not None:  # every rank decides together (Note [Ranks agree on a plan])
            decision = joint.decide(seq, *self.rates(), ranks=self.ranks, declines=declines)
            if decision.plan is None and declines:
                return self.decline(need)
            again = self.apply(decision)
            if again is not None:
                return again
        elif declines:
            if joint is not None:
                joint.profiling_done()
            return self.decline(need)
        elif undecided:
            again = self.apply(joint.decide(seq, *self.rates()))
            if again is not None:
                return again
        if error is not None:
            raise error
        return self.schedule(seq, need)

    def decline(self, need: int) -> None:
        """The run fits the budget without swapping: not swapping (the executor declines on None)."""
        self.notices.note(f"the run fits the budget without swapping (peak {fmt_bytes(need)} <= "
                          f"{fmt_bytes(self.budget)}): not swapping")  # fmt: skip

    def apply(self, decision: JointDecision) -> Optional[Reprofile]:
        """Applies the joint runtime's decision (Note [Applying a joint plan], step 3): rebuilds on, modules
        wrapped; a ``Reprofile`` if what the model saves changed."""
        p = decision.plan
        if p is not None:
            if p.rebuild:
                self.hooks.enable_rebuilds()
            if p.regions:
                self.joint.regions.apply(p, decision.modules)
        if decision.note:
            self.notices.note(decision.note)
        return Reprofile(decision.profile_again) if p is not None else None

    def schedule(self, seq: Sequence, no_swap: Optional[int] = None) -> Schedule:
        h2d, d2h = self.rates()
        policy = self.joint.swap_policy if self.joint is not None else self.policy
        window, schedule, _ = schedule_for(
            seq, self.budget, policy, h2d, d2h, window=self.window,
            swapout_threshold=self.swapout_threshold, swapin_ahead=self.swapin_ahead,
        )  # fmt: skip
        self.window_used = window
        no_swap = seq.no_swap_peak() if no_swap is None else no_swap
        log.info(
            "swap: planned %d steps, %d variables: peak %.1f MiB of budget %.1f MiB (%.1f MiB without swapping)%s",
            len(seq), len(seq.sizes), schedule.peak / 2**20, self.budget / 2**20, no_swap / 2**20,
            f", window {window / 2**20:.1f} MiB" if window else "",
        )  # fmt: skip
        return schedule
