"""Train small models with and without swapping, recording losses and every gradient (as numpy copies,
which no meter counts as device memory)."""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Optional

import numpy as np
import torch

from bench import models

KiB = 1024

SMALL = {
    "resnet": (lambda: models.resnet((1, 1, 1, 1), width=8, num_classes=10), 8, 64),
    "unet": (lambda: models.unet(depth=3, width=8), 4, 64),
    "gpt": (lambda: models.gpt(n_layer=2, n_head=4, d_model=64, vocab=256, seq_len=64), 8, 64),
}


def run(
    name: str,
    iterations: int = 3,
    manager: Optional[Callable[[], Any]] = None,
    meter: Optional[Any] = None,
    batches: Optional[list[int]] = None,
    wrap: Optional[Callable[[torch.nn.Module], torch.nn.Module]] = None,
) -> dict[str, Any]:
    build, batch, size = SMALL[name]
    gc.collect()  # garbage of earlier runs is live memory to a meter: start every run from the same state
    torch.manual_seed(0)
    model = build()
    if wrap is not None:
        model = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, grads = [], []
    sm = manager() if manager else None
    with contextlib.ExitStack() as stack:
        if meter is not None:
            stack.enter_context(meter.track_existing())
        if sm is not None:
            stack.enter_context(sm)
        for it in range(iterations):
            # Made one at a time, so runs of any length hold the same data on the device.
            x, y = models.example_batch(
                model, batches[it] if batches else batch, size, torch.Generator().manual_seed(it)
            )
            loss = models.loss_fn(model, model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            losses.append(loss.item())
            grads.append([p.grad.detach().numpy().copy() for p in model.parameters()])
            opt.step()
    return {"losses": losses, "grads": grads, "manager": sm}


def assert_bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["losses"] == b["losses"]
    for it, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
        for k, (x, y) in enumerate(zip(ga, gb)):
            assert np.array_equal(x, y), f"iteration {it}: gradient {k} differs"
