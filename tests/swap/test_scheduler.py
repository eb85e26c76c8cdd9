"""The scheduler on hand-built sequences whose right answer is known, and a property test that no policy
ever plans above the budget."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from schedule_check import check_schedule

import swap
from swap import InfeasibleBudget, Sequence, choose_window, make_schedule, simulate


def chain(n_layers=4, size=100, nonswap=50):
    """Forward saves v0..v(n-1); backward uses them in reverse."""
    var = list(range(n_layers)) + list(reversed(range(n_layers)))
    kind = ["save"] * n_layers + ["use"] * n_layers
    return Sequence(var, kind, [size] * n_layers, [nonswap] * (2 * n_layers), [1.0] * (2 * n_layers))


def test_window_on_a_chain_matches_the_hand_worked_plan():
    seq = chain()
    s = make_schedule(seq, budget=300, window=200, policy="window")
    # v3 is used again inside the window: never swapped. v0..v2 reserved at their save; completed oldest
    # first when room is needed; v2 comes back for free (never completed, so its copy is never made: Note
    # [Copies nothing needs]); v1, v0 one step ahead.
    assert s.swap_out == [[0], [1], [], [], [], [], [], []]
    assert s.release == [[], [], [0], [1], [], [], [], []]
    assert s.swap_in == [[], [], [], [], [], [1], [0], []]
    assert s.peak == 250
    check_schedule(seq, s)


def test_window_that_covers_everything_swaps_in_nothing_it_kept():
    seq = chain()
    s = make_schedule(seq, budget=10_000, window=10_000, policy="window")
    assert s.release == [[]] * 8 and s.swap_in == [[]] * 8  # everything stays: nothing to bring back


def test_a_roomier_budget_copies_out_only_what_it_drops():
    """Note [Copies nothing needs]: every reserved swap-out used to copy, dropped or not, so a plan with room to
    spare moved as many bytes to the host as a tight one."""
    seq = chain(6)
    tight, roomy = (make_schedule(seq, budget=b, window=200, policy="window") for b in (400, 550))
    for s in (tight, roomy):
        assert {v for step in s.swap_out for v in step} == {v for step in s.release for v in step}
        check_schedule(seq, s)
    assert 0 < roomy.bytes_out(seq) < tight.bytes_out(seq)


def test_no_swap_out_for_a_variable_never_used_again():
    seq = Sequence([0, 1, 1], ["save", "save", "use"], [100, 100], [0, 0, 0], [1, 1, 1])
    for policy in ("window", "all", "fixed_distance"):
        s = make_schedule(seq, 1000, 100 if policy == "window" else None, policy)
        assert 0 not in [v for step in s.swap_out for v in step], policy


def test_all_releases_at_the_next_step_and_prefetches_one_ahead():
    s = make_schedule(chain(), budget=1000, policy="all")
    assert s.swap_out[:3] == [[0], [1], [2]]
    assert s.release[1:4] == [[0], [1], [2]]
    assert s.swap_in[4:7] == [[2], [1], [0]]  # each one step before its use


def test_fixed_distance_threshold_and_ahead():
    seq = chain(6)
    s = make_schedule(seq, 10_000, policy="fixed_distance", swapout_threshold=5, swapin_ahead=2)
    # Distances to the next use: v0 11, v1 9, v2 7, v3 5, v4 3, v5 1 -> v0..v3 go out.
    assert sorted(v for step in s.swap_out for v in step) == [0, 1, 2, 3]
    uses = {seq.var[i]: i for i in range(6, 12)}
    for v in (0, 1, 2, 3):
        (step,) = [i for i, vs in enumerate(s.swap_in) if v in vs]
        assert step == uses[v] - 2
    check_schedule(seq, s)


def test_budget_guard_evicts_when_the_policy_would_not():
    # fixed_distance with a huge threshold swaps nothing by choice; the guard must still fit the budget.
    seq = chain(6)
    s = make_schedule(seq, 350, policy="fixed_distance", swapout_threshold=100)
    assert s.peak <= 350
    assert any(s.release)
    check_schedule(seq, s)


def test_infeasible_budget_names_the_step_and_excess():
    seq = Sequence([0, 1, 1, 0], ["save", "save", "use", "use"], [100, 400], [50, 40, 90, 50], [1] * 4)
    with pytest.raises(InfeasibleBudget) as e:
        make_schedule(seq, 450, 100, "window")
    assert e.value.step == 2 and e.value.excess == 90 + 400 - 450
    assert "step 2" in str(e.value) and "40 B over" in str(e.value)


def test_a_variable_the_forward_still_holds_is_not_released():
    # v0 is held by the forward until step 3 (a residual input): the guard must release v1 instead.
    seq = Sequence([0, 1, 2, 0, 2, 1, 0], ["save", "save", "save", "save", "use", "use", "use"],
                   [100, 100, 100], [0] * 7, [1.0] * 7, held_until=[3, 0, 0])  # fmt: skip
    s = make_schedule(seq, 250, policy="fixed_distance", swapout_threshold=100)
    assert 1 in s.release[2] and all(0 not in s.release[i] for i in range(3))
    check_schedule(seq, s)
    with pytest.raises(InfeasibleBudget, match="100 B held by the forward pass"):
        make_schedule(Sequence([0, 1, 0, 1], ["save", "save", "use", "use"], [100, 100], [0] * 4, [1.0] * 4,
                      held_until=[4, 0]), 150, policy="all")  # fmt: skip


def test_none_keeps_everything_and_says_when_it_cannot():
    seq = chain()
    assert make_schedule(seq, 450, policy="none").peak == 450
    with pytest.raises(InfeasibleBudget, match="keeps every saved tensor"):
        make_schedule(seq, 449, policy="none")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"budget": 100, "window": 10, "policy": "lru"}, "unknown policy 'lru'"),
        ({"budget": -1, "window": 10, "policy": "window"}, "budget must be positive"),
        ({"budget": 100, "window": 200, "policy": "window"}, "larger than the budget"),
        ({"budget": 100, "window": None, "policy": "window"}, "needs a window"),
    ],
)
def test_bad_arguments_fail_fast(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_schedule(chain(), **kwargs)


def test_simulator_lower_bound_and_stalls():
    seq = chain(4, size=100)
    s = make_schedule(seq, 250, 100, "window")
    fast = simulate(seq, s, 1e9, 1e9)
    assert fast.stall_time < 1e-6 and fast.step_time == pytest.approx(8.0)
    slow = simulate(seq, s, 10, 10)  # 10 s per copy: the copies dominate
    assert slow.stall_time > 0 and slow.step_time >= slow.lower_bound
    assert slow.lower_bound == pytest.approx(max(8.0, slow.h2d_bytes / 10, slow.d2h_bytes / 10))


def test_choose_window_prefers_the_fastest_smallest_window():
    seq = chain(8, size=100, nonswap=0)
    w, s, sim = choose_window(seq, 500, 100, 100)
    assert s.window == w <= 500
    for other in (100, 200, 300, 500):
        assert sim.step_time <= simulate(seq, make_schedule(seq, 500, other, "window"), 100, 100).step_time * 1.01


@st.composite
def sequences(draw):
    n_vars = draw(st.integers(1, 8))
    sizes = [draw(st.integers(1, 100)) for _ in range(n_vars)]
    var, kind, seen = [], [], set()
    for _ in range(draw(st.integers(n_vars, 30))):
        v = draw(st.integers(0, n_vars - 1))
        var.append(v)
        kind.append("save" if v not in seen or draw(st.booleans()) and len(seen) < n_vars else "use")
        seen.add(v)
    # every variable must be saved before use: rebuild kinds honouring that
    seen = set()
    for i, v in enumerate(var):
        if v not in seen:
            kind[i] = "save"
        seen.add(v)
    n = len(var)
    nonswap = [draw(st.integers(0, 100)) for _ in range(n)]
    swappable = [draw(st.booleans()) for _ in range(n_vars)]  # False: kept resident, never swapped
    held = [draw(st.integers(0, n)) if draw(st.booleans()) else 0 for _ in range(n_vars)]
    return Sequence(var, kind, sizes, nonswap, [1.0] * n, swappable, held)


@settings(max_examples=300, deadline=None)
@given(
    seq=sequences(),
    budget=st.integers(1, 600),
    window=st.integers(1, 600),
    policy=st.sampled_from(["window", "fixed_distance", "all", "none"]),
)
def test_no_policy_plans_above_the_budget(seq, budget, window, policy):
    window = min(window, budget)
    try:
        s = make_schedule(seq, budget, window, policy)
    except InfeasibleBudget as e:
        if policy == "none":
            assert seq.no_swap_peak() > budget
        elif all(h == 0 for h in seq.held_until):
            need = [seq.nonswap[i] + seq.sizes[seq.var[i]] for i in range(len(seq))]
            assert max(need) > budget and need[e.step] > budget
        else:
            assert e.needed > budget  # what the forward holds, plus the step's own working set
        return
    assert s.peak <= budget
    check_schedule(seq, s)
    moved = {v for steps in (s.swap_out, s.release, s.swap_in) for vs in steps for v in vs}
    assert not any(not seq.swappable[v] for v in moved), "a variable that is not swappable was moved"


# -- InfeasibleBudget: the largest failing step, its module, its breakdown, and the lever ---------------------
def test_infeasible_budget_reports_the_largest_failing_step_not_the_first():
    # Step 1 needs 10 more than the budget, step 3 needs 100 more: min_budget must cover step 3.
    seq = Sequence([0, 1, 1, 0], ["save", "save", "use", "use"], [100, 100], [0, 110, 0, 200], [1.0] * 4,
                   modules=["enc.layer.0", "enc.layer.1"])  # fmt: skip
    with pytest.raises(InfeasibleBudget) as e:
        make_schedule(seq, 200, 100, "window")
    err = e.value
    assert err.step == 3 and err.min_budget == 300 and err.excess == 100 and err.failing_steps == 2
    assert err.phase == "end of iteration" and err.lever == "budget"
    s = make_schedule(seq, err.min_budget, 100, "window")  # min_budget is enough
    assert s.peak <= err.min_budget


@pytest.mark.parametrize(
    "kept, held_until, transient, expect",
    [
        ([0, 80, 0, 0, 0, 0], [0, 0, 0], 10, "min_bytes"),  # saved tensors kept by min_bytes explain the excess
        ([0] * 6, [3, 0, 0], 10, "checkpoint"),  # the forward holds v0 through step 1
        ([0] * 6, [0, 0, 0], 90, "batch"),  # the step's own working set (what its operation allocates)
    ],
)
def test_infeasible_budget_names_the_module_and_the_lever(kept, held_until, transient, expect):
    seq = Sequence([0, 1, 2, 2, 1, 0], ["save", "save", "save", "use", "use", "use"], [100, 100, 10],
                   [0, 100, 0, 0, 0, 0], [1.0] * 6, held_until=held_until, kept=kept,
                   transient=[0, transient, 0, 0, 0, 0],
                   modules=["enc.layer.0", "enc.layer.1.attention", "head"])  # fmt: skip
    need = swap.schedule.budget.min_budget(seq)
    with pytest.raises(InfeasibleBudget) as e:
        make_schedule(seq, need - 50, 100, "window")
    err = e.value
    assert err.step == 1 and err.module == "enc.layer.1.attention" and err.phase == "forward"
    assert err.lever == expect and "the forward of enc.layer.1.attention needs" in str(err)
    assert err.not_swappable + err.held_by_forward + err.working_set == need
    if expect == "checkpoint":  # v0 (100) and the activations the step did not allocate (90)
        assert err.held_by_forward == 190 and "Checkpoint enc.layer.1.attention" in str(err)


def test_a_backward_node_holds_what_it_unpacked_until_it_has_run():
    # A compiled region's backward unpacks v0, v1, v2 at once (node_last): releasing v0 at step 4 frees nothing.
    seq = Sequence([0, 1, 2, 0, 1, 2], ["save"] * 3 + ["use"] * 3, [100, 100, 100], [0] * 6, [1.0] * 6,
                   node_last=[0, 1, 2, 5, 5, 5], freed=[6, 6, 6])  # fmt: skip
    assert swap.schedule.budget.step_floors(seq)[5] == 300
    with pytest.raises(InfeasibleBudget):
        make_schedule(seq, 299, policy="all")
    s = make_schedule(seq, 300, policy="all")
    assert all(0 not in s.release[i] for i in (4, 5))
    check_schedule(seq, s)
