"""The tiled VGG-style CNN of test_tiled_budget, judged by the independent sweep meter (Note [Sweeping every
storage], tests/swap/sweep_meter.py) that re-reads every live storage's size at each operator: every iteration
within the budget, and the tiled model's own meter (swap.LiveBytesMeter) within 1 % of it."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
from test_tiled_budget import train_step, vgg_style

import swap

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sweep_meter import SweepMeter  # noqa: E402


def test_a_tiled_cnn_is_within_its_budget_by_the_sweep_meter() -> None:
    gc.collect()
    live = swap.LiveBytesMeter()
    with live.track_existing():
        foreign = live.live  # what earlier tests keep alive: the caller's extra
    torch.manual_seed(0)
    model = vgg_style()
    x, y = torch.randn(1, 3, 256, 256), torch.tensor([1])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with live.track_existing():
        train_step(model, opt, x, y)
        static = live.live
        live.reset_window()
        train_step(model, opt, x, y)
        untiled = live.reset_window()
    budget = int(static + 0.1 * (untiled - static))
    opt.zero_grad(set_to_none=True)
    tiled = swap.tiled(model, budget=budget, extra=foreign)
    gc.collect()
    sweep, peaks, own = SweepMeter().track_existing(), [], []
    # Storages earlier tests of the same process keep alive that the sweep meter finds and LiveBytesMeter's walk
    # (whose count the caller's extra is) does not: not the training's, so not held against its budget.
    now = swap.LiveBytesMeter()
    with now.track_existing():
        unseen = max(0, sweep.sweep() - now.live)
    with live.track_existing(), sweep:
        for _ in range(2):
            sweep.reset_window()
            live.reset_window()
            train_step(tiled, opt, x, y)
            peaks.append(sweep.reset_window() - unseen)
            own.append(live.reset_window())
    assert max(peaks) <= budget, f"peaks by the sweep meter {peaks} (less {unseen} B alive before that only it " \
        f"sees) over the budget {budget} (own meter: {own})"
    assert all(abs(a - b) <= 0.01 * a for a, b in zip(peaks, own)), (peaks, own)
