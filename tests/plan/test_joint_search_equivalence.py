"""The joint search chooses exactly what it chose with the old prefetch walk and window sweep
(tests/reference_scheduler.py): the same best plan, and for every plan it judged the same window, schedule and
simulated iteration, on block chains at budgets from tight to roomy and links from slow to fast."""

from __future__ import annotations

import pytest
from reference_scheduler import ref_choose_window, ref_plan
from test_joint_planning import blocks

import swap.schedule.simulator as simulator
from swap.joint.search import Evaluator, Outcome, search


def judged(o: Outcome) -> tuple:
    """Everything an outcome says about its plan, keep sets in a fixed order."""
    s = o.strategy
    regions = tuple((r.path, tuple(sorted(r.keep))) for r in s.plan.regions)
    return (s.name, s.swap, s.detail, s.plan.rebuild, regions, o.feasible, o.step_time, o.why, o.window,
            o.schedule, o.sim)  # fmt: skip


def run(seq, table, budget: int, link: float) -> tuple:
    ev = Evaluator(seq, table, budget, link, link)
    result = search(ev, max_evaluations=150)
    every = sorted((judged(o)[3:5], key[1], judged(o)[5:]) for key, o in ev._outcomes.items())
    return judged(result.best), {k: judged(o) for k, o in result.baselines.items()}, result.evaluations, every


@pytest.mark.parametrize(("n", "fraction", "link"), [(4, 0.45, 5e6), (5, 0.6, 5e7), (6, 0.8, 1e6), (3, 1.1, 1e9)])
def test_the_search_judges_every_plan_as_the_old_scheduler_did(monkeypatch, n, fraction, link):
    seq, table = blocks(n, 3, [40_000, 80_000, 20_000, 60_000], [0.001, 0.004, 0.002])
    budget = int(seq.no_swap_peak() * fraction)
    new = run(seq, table, budget, link)
    monkeypatch.setattr(simulator, "plan", ref_plan)
    monkeypatch.setattr(simulator, "choose_window", ref_choose_window)
    old = run(seq, table, budget, link)
    assert new[0][5] and new[2] > 20  # a feasible plan, found among many
    assert new == old
