"""Train small models with and without swapping, recording losses, every gradient (as numpy copies, which no
meter counts as device memory) and, with a meter, each iteration's peak (the optimizer step included)."""

from __future__ import annotations

import gc
from typing import Any, Callable, Optional

import numpy as np
import torch

from bench.metering import metered
from swap.forecast import zoo as models

KiB = 1024

SMALL = {
    "resnet": (lambda: models.resnet((1, 1, 1, 1), width=8, num_classes=10), 8, 64),
    "unet": (lambda: models.unet(depth=3, width=8), 4, 64),
    "gpt": (lambda: models.gpt(n_layer=2, n_head=4, d_model=64, vocab=256, seq_len=64), 8, 64),
}

# A pattern runs one training step's forward and backward passes and returns the loss to record.
Pattern = Callable[[torch.nn.Module, Any, Any, int], torch.Tensor]


def standard(model: torch.nn.Module, x: Any, y: Any, it: int) -> torch.Tensor:
    loss = models.loss_fn(model, model(x), y)
    loss.backward()
    return loss


def run(
    name: str,
    iterations: int = 3,
    manager: Optional[Callable[[], Any]] = None,
    meter: Optional[Any] = None,
    batches: Optional[list[int]] = None,
    wrap: Optional[Callable[[torch.nn.Module], torch.nn.Module]] = None,
    pattern: Pattern = standard,
    build: Optional[Callable[[], torch.nn.Module]] = None,
    batch_fn: Optional[Callable[[torch.nn.Module, int], tuple[Any, Any]]] = None,
) -> dict[str, Any]:
    """Trains ``name`` (or ``build()``) for ``iterations`` with SGD and momentum. Returns losses, grads, the
    manager, and ``peaks`` (the meter's peak in each iteration, when a meter is given)."""
    gc.collect()  # garbage of earlier runs is live memory to a meter: start every run from the same state
    default_build, batch, size = SMALL.get(name, (None, 8, 64))
    torch.manual_seed(0)
    model = (build or default_build)()
    if wrap is not None:
        model = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, grads, peaks = [], [], []
    sm = manager() if manager else None
    with metered(meter, sm):
        for it in range(iterations):
            # Made one at a time, so runs of any length hold the same data on the device.
            if batch_fn is not None:
                x, y = batch_fn(model, it)
            else:
                x, y = models.example_batch(
                    model, batches[it] if batches else batch, size, torch.Generator().manual_seed(it)
                )
            opt.zero_grad(set_to_none=True)
            loss = pattern(model, x, y, it)
            losses.append(loss.item())
            grads.append([p.grad.detach().numpy().copy() for p in model.parameters()])
            opt.step()
            del loss
            if meter is not None:
                peaks.append(meter.reset_window())
    buffers = [b.detach().numpy().copy() for b in model.buffers()]  # BatchNorm's running statistics, counters
    return {"losses": losses, "grads": grads, "manager": sm, "peaks": peaks, "buffers": buffers}


def assert_bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["losses"] == b["losses"]
    assert all(np.array_equal(x, y) for x, y in zip(a["buffers"], b["buffers"])), "a buffer differs"
    assert len(a["grads"]) == len(b["grads"])
    for it, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
        for k, (x, y) in enumerate(zip(ga, gb)):
            assert np.array_equal(x, y), f"iteration {it}: gradient {k} differs"


def assert_within(peaks: list[int], budget: int) -> None:
    """Every iteration, profiling included, stayed within the budget (as an independent meter saw it)."""
    over = [(i, p - budget) for i, p in enumerate(peaks) if p > budget]
    assert not over, f"iterations over the budget of {budget} bytes (iteration, excess): {over}; peaks {peaks}"
