"""Note [Benchmark trials are not the floor]: with cudnn.benchmark on, the first iteration's engine trials hold
large workspaces for a moment; a plan must not make them every step's floor. Driven on the lifecycle directly
with the profiles such a run measures (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from swap.runtime.activations.hooks import SavedTensorHooks
from swap.runtime.activations.lifecycle import DECLINED, Counters, Lifecycle, Profiled
from swap.runtime.notices import Notices
from swap.runtime.scheduling import Scheduling
from swap.schedule.budget import InfeasibleBudget, min_budget
from swap.schedule.sequence import Sequence

MiB = 1 << 20
TRIALS = 2048 * MiB  # what the trials of one convolution held, once


def profile(trials: bool) -> Sequence:
    """Two convolutions saving their inputs, and their backward; the first iteration's trials at steps 0 and 1."""
    nonswap = [40 * MiB, 60 * MiB, 50 * MiB, 45 * MiB]
    transient = [10 * MiB, 20 * MiB, 10 * MiB, 5 * MiB]
    if trials:
        nonswap[:2] = [n + TRIALS for n in nonswap[:2]]
        transient[:2] = [n + TRIALS for n in transient[:2]]
    return Sequence([0, 1, 1, 0], ["save", "save", "use", "use"], [8 * MiB, 8 * MiB], nonswap, [1e-3] * 4,
                    transient=transient)  # fmt: skip


def planned_on(benchmark: bool) -> list[Profiled]:
    seen: list[Profiled] = []

    def planner(p: Profiled) -> None:
        seen.append(p)
        return None  # judge only: the last one declines

    life = Lifecycle(256 * MiB, Counters(), planner, lambda seq: None, lambda cause, msg: None, lambda peak: None,
                     2, trials=lambda: benchmark)  # fmt: skip
    life.profiled(profile(trials=True), 0, 0, 1024 * MiB, 2200 * MiB, [])
    life.profiled(profile(trials=False), 0, 0, 100 * MiB, 100 * MiB, [])
    assert life.mode == DECLINED
    return seen


def test_the_first_iterations_trials_are_not_the_plans_floor():
    first, final = planned_on(benchmark=True)
    assert first.trials and final.trials
    assert final.sequence.nonswap == profile(trials=False).nonswap
    assert final.sequence.transient == profile(trials=False).transient
    assert min_budget(final.sequence) < 256 * MiB and final.unswapped_peak == 100 * MiB


def test_without_benchmark_the_profiles_merge_as_before():
    _, final = planned_on(benchmark=False)
    assert not final.trials
    assert final.sequence.nonswap == profile(trials=True).nonswap  # the element-wise larger
    assert final.unswapped_peak == 1024 * MiB


def test_a_first_profile_with_trials_is_not_judged_infeasible_alone():
    hooks = SavedTensorHooks(torch.device("cpu"), 0, None, False)
    s = Scheduling(256 * MiB, None, "window", 2, 1, None, hooks, Notices(), None)
    first = Profiled(profile(trials=True), False, 0, None, 2200 * MiB)
    with pytest.raises(InfeasibleBudget):
        s.profiled(first)
    assert s.profiled(Profiled(profile(trials=True), False, 0, None, 2200 * MiB, trials=True)) is None
