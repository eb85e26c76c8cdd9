"""The incremental prefetch pass and the window sweep (Note [An incremental prefetch queue], Note [Windows with
the same plan]) give exactly the schedules, and ``choose_window`` exactly the window, schedule and simulated
iteration, of the old walk kept in tests/reference_scheduler.py, on random sequences with every feature the
planner reads (clean and unswappable variables, held_until, node_last, freed)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from reference_scheduler import ref_choose_window, ref_plan

from swap.schedule.budget import InfeasibleBudget, min_budget
from swap.schedule.scheduler import plan, plan_windows
from swap.schedule.sequence import SAVE, USE, Sequence
from swap.schedule.simulator import choose_window


@st.composite
def sequences(draw: st.DrawFn) -> Sequence:
    n_vars = draw(st.integers(1, 10))
    sizes = [draw(st.integers(1, 100)) for _ in range(n_vars)]
    clean = [draw(st.integers(0, 4)) == 0 for _ in range(n_vars)]
    var = [draw(st.integers(0, n_vars - 1)) for _ in range(draw(st.integers(n_vars, 80)))]
    seen = {v for v, c in enumerate(clean) if c}
    kind = []
    for v in var:  # a variable is saved before it is used, unless it is clean
        kind.append(SAVE if v not in seen or draw(st.integers(0, 3)) == 0 else USE)
        seen.add(v)
    n = len(var)
    node_last = [i if k == SAVE else min(n - 1, i + draw(st.integers(0, 2))) for i, k in enumerate(kind)]
    last = {v: i for i, v in enumerate(var)}
    freed = ([min(n, last.get(v, 0) + 1 + draw(st.integers(0, 3))) for v in range(n_vars)]
             if draw(st.booleans()) else [])  # fmt: skip
    return Sequence(
        var, kind, sizes, [draw(st.integers(0, 100)) for _ in range(n)],
        [draw(st.floats(0.0, 2.0)) for _ in range(n)],
        swappable=[draw(st.integers(0, 5)) > 0 for _ in range(n_vars)],
        held_until=[draw(st.integers(0, n)) if draw(st.booleans()) else 0 for _ in range(n_vars)],
        freed=freed, node_last=node_last, clean=clean,
    )  # fmt: skip


def outcome(fn, *args, **kwargs):
    """What a call returns, or the error it raises (type and message)."""
    try:
        return fn(*args, **kwargs)
    except (InfeasibleBudget, ValueError) as e:
        return type(e).__name__, str(e)


@settings(max_examples=400, deadline=None)
@given(
    seq=sequences(),
    extra=st.integers(0, 80),
    window=st.integers(1, 700),
    policy=st.sampled_from(["window", "fixed_distance", "all"]),
    threshold=st.integers(1, 4),
    ahead=st.integers(1, 4),
)
def test_every_policy_plans_what_the_old_prefetch_walk_planned(seq, extra, window, policy, threshold, ahead):
    budget = max(1, min_budget(seq) + extra)  # tight: prefetches that do not fit, reservations kept for later
    window = min(window, budget)
    kw = {"swapout_threshold": threshold, "swapin_ahead": ahead}
    assert outcome(plan, seq, budget, window, policy, **kw) == outcome(ref_plan, seq, budget, window, policy, **kw)


@settings(max_examples=300, deadline=None)
@given(seq=sequences(), extra=st.integers(-10, 300), h2d=st.sampled_from([5.0, 50.0, 1e3]),
       d2h=st.sampled_from([5.0, 50.0, 1e3]), vmm=st.booleans())  # fmt: skip
def test_choose_window_chooses_what_the_old_sweep_chose(seq, extra, h2d, d2h, vmm):
    budget = max(1, min_budget(seq) + extra)
    cost = (lambda s: [0.01 * len(r) for r in s.release]) if vmm else None  # per-schedule host seconds
    new = outcome(choose_window, seq, budget, h2d, d2h, vmm=cost)
    old = outcome(ref_choose_window, seq, budget, h2d, d2h, vmm=cost)
    assert new == old  # window, schedule and simulated iteration (its actions too), or the same error


def test_windows_with_the_same_ends_are_planned_once():
    # Two variables of 10 bytes saved then used: every window from 40 bytes on covers the whole iteration.
    seq = Sequence([0, 1, 1, 0], [SAVE, SAVE, USE, USE], [10, 10], [5] * 4, [1.0] * 4)
    planned = list(plan_windows(seq, 100, [10, 20, 40, 60, 100]))
    assert [w for w, _ in planned] == [10, 20, 40]
    for w, sched in planned:
        assert sched == ref_plan(seq, 100, w, "window")
    assert choose_window(seq, 100, 10.0, 10.0, candidates=[10, 20, 40, 60, 100]) == ref_choose_window(
        seq, 100, 10.0, 10.0, candidates=[10, 20, 40, 60, 100])
