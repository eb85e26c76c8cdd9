"""Gradients in flight to the host are capped at what the plan prices (Note [Gradients in flight] in
swap/runtime/model_state/gradients.py): with the lane that lets go of each device gradient slowed down on purpose
(a loaded host), the run keeps its budget in every iteration and trains bitwise as plain torch; without the cap
the same run's gradients pile up and the budget is refused."""

import functools
import time

import pytest
import torch
from ms_loops import VOCAB, assert_same, plain_step, run, within
from sweep_meter import SweepMeter

import swap
from swap.runtime.model_state import gradients

BUDGET = 7 << 20  # the capped run peaks at about 6.9 MB here, the uncapped one needs 8.2 MB (min_budget=8195112)
ITERS = 4


def wide() -> torch.nn.Module:
    """An MLP whose 1 MiB gradients are copied on the copy engine's worker (past its inline size), not inline."""
    layers = [torch.nn.Embedding(VOCAB, 128), torch.nn.Linear(128, 512)]
    for _ in range(6):
        layers += [torch.nn.ReLU(), torch.nn.Linear(512, 512)]
    layers += [torch.nn.ReLU(), torch.nn.Linear(512, VOCAB)]
    return torch.nn.Sequential(*layers)


def manager(model, opt):
    return swap.SwapManager(budget=BUDGET, device="cpu", model=model, optimizer=opt)


@functools.cache
def plain():
    return run(wide, plain_step, iters=ITERS)


@pytest.fixture
def slow_lane(monkeypatch):
    """Each gradient's landing (the lane's work that holds the device gradient) starts 30 ms late."""
    landed = gradients.GradSink._landed
    calls = []

    def late(self, ticket, box):
        calls.append(1)
        time.sleep(0.03)
        return landed(self, ticket, box)

    monkeypatch.setattr(gradients.GradSink, "_landed", late)
    return calls


def unchecked(monkeypatch):
    """Gradients left in flight whatever the budget's room (Note [Gradients in flight keep the budget] off)."""
    init = gradients.GradSink.__init__

    def no_check(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.fits = lambda nbytes: True

    monkeypatch.setattr(gradients.GradSink, "__init__", no_check)


def test_a_slow_lane_keeps_the_budget_and_trains_bitwise(slow_lane):
    got = run(wide, plain_step, iters=ITERS, manager=manager, meter=SweepMeter("cpu"))
    within(got, BUDGET)
    assert_same(plain(), got)
    # every backward's seven gradients past the inline size went through the lane, but the first's: before a
    # profile, no gradient is left in flight (Note [Gradients in flight keep the budget])
    assert len(slow_lane) >= 7 * (ITERS - 1)


def test_without_the_cap_a_slow_lane_goes_over(slow_lane, monkeypatch):
    """What the cap prevents: every gradient of the backward alive at once, past the budget (with the budget's
    own check off: Note [Gradients in flight keep the budget] would wait for them too)."""
    monkeypatch.setattr(gradients, "IN_FLIGHT", 10**6)
    unchecked(monkeypatch)
    with pytest.raises(swap.InfeasibleBudget, match="budget of 7.00 MiB"):
        run(wide, plain_step, iters=ITERS, manager=manager, meter=SweepMeter("cpu"))
