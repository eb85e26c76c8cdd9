"""A tiled model holds its budget in a training loop: the optimizer's state and kept gradients are counted
(Note [What the step holds besides the graph] in swap/tiling/run/held.py)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import swap


def vgg_style(c: int = 8) -> nn.Sequential:
    """3x3 convolutions and ReLU in blocks closed by max pooling, a global-pool head."""
    layers: list[nn.Module] = []
    cin = 3
    for k, n in enumerate((1, 1, 2, 2)):
        for _ in range(n):
            layers += [nn.Conv2d(cin, c * 2**k, 3, padding=1), nn.ReLU(inplace=True)]
            cin = c * 2**k
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


@pytest.mark.parametrize("optimizer_first", [True, False], ids=["optimizer-stepped-before", "optimizer-after"])
def test_a_tiled_cnn_with_momentum_holds_its_budget_every_iteration(optimizer_first: bool) -> None:
    gc.collect()  # an earlier test's garbage is live memory to the meter
    meter = swap.LiveBytesMeter()
    with meter.track_existing():
        # What earlier tests keep alive (module-level caches of models and results) is live to the meter and
        # unknown to the plan: the caller's own tensors, which ``extra=`` is for.
        foreign = meter.live
    torch.manual_seed(0)
    model = vgg_style()
    x, y = torch.randn(1, 3, 256, 256), torch.tensor([1])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with meter.track_existing():
        train_step(model, opt, x, y)
        static = meter.live  # parameters, momentum, gradients, the batch
        meter.reset_window()
        train_step(model, opt, x, y)
        untiled = meter.reset_window()
    momentum = sum(p.numel() * 4 for p in model.parameters())
    budget = int(static + 0.1 * (untiled - static))  # 10 % of the way from the static memory to the untiled peak
    opt.zero_grad(set_to_none=True)
    if not optimizer_first:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)  # no state until its first step
    tiled = swap.tiled(model, budget=budget, extra=foreign)
    peaks = []
    with meter.track_existing():
        for _ in range(2):  # the second is planned again when the optimizer's state is new in the first
            meter.reset_window()
            train_step(tiled, opt, x, y)
            peaks.append(meter.reset_window())
    assert tiled.last_plan.segments and tiled.last_plan.peak <= budget
    # Without the momentum buffers the plan would have fit at fewer tiles and run over by their size.
    assert max(peaks) <= budget, f"peaks {peaks} over the budget {budget} (momentum {momentum})"


def test_a_budget_no_tiling_fits_names_the_smallest_budget() -> None:
    model = vgg_style()
    x = torch.randn(1, 3, 256, 256)
    with pytest.raises(swap.TilingInfeasible) as info:
        swap.tiled(model, budget=1 << 20).plan_for(x)
    smallest = info.value.min_budget
    assert smallest > 1 << 20
    assert swap.tiled(model, budget=smallest).plan_for(x)[0].peak <= smallest
