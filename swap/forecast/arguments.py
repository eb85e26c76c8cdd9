"""``swap.plan``'s arguments, checked before anything is captured: each wrong one fails with a message that says
what to pass instead (the command line says the same with its own flags)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from ..capture import default_optimizer

OptimizerFn = Callable[[Any], torch.optim.Optimizer]


def check_model_fn(model_fn: Any, what: str = "model_fn") -> None:
    """``model_fn`` builds the model when called: a class or a function, not a model already built. swap.plan
    calls it under the meta device, where the model takes no memory whatever its size; a built model would
    only be called as its forward, which then blames a missing input."""
    if isinstance(model_fn, nn.Module):
        cls = type(model_fn).__name__
        raise TypeError(
            f"{what} must build the model when called, not be the model: got a {cls} instance. swap.plan builds "
            f"it on the meta device (no memory, whatever its size): pass {cls} (the class) or lambda: {cls}(...)"
        )
    if not callable(model_fn):
        raise TypeError(f"{what} must be a function (or class) that builds the model, not {type(model_fn).__name__}")


def check_functions(batch_fn: Any, loss_fn: Any) -> None:
    """``batch_fn(n)`` and ``loss_fn(model, batch)`` (or None) are functions, not a batch or a loss."""
    if not callable(batch_fn) or isinstance(batch_fn, nn.Module):
        raise TypeError(f"batch_fn must be a function: batch_fn(n) returns a batch of n samples, not "
                        f"{type(batch_fn).__name__}")  # fmt: skip
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function loss_fn(model, batch) -> loss, or None, not "
                        f"{type(loss_fn).__name__}")  # fmt: skip


def check_names(names: Any, what: str, one: str, known: tuple[str, ...]) -> tuple[str, ...]:
    """A tuple of names (``what``: "policies", "strategies"), each ``one`` of ``known``; a lone string is refused,
    since it would be read letter by letter."""
    if isinstance(names, str):
        raise TypeError(f"{what} takes a tuple of names, such as ({names!r},), not a string")
    names = tuple(names)
    for name in names:
        if name not in known:
            raise ValueError(f"unknown {one} {name!r}: choose among {', '.join(known)}")
    return names


def with_parameters(optimizer: Optional[OptimizerFn]) -> OptimizerFn:
    """``optimizer`` (default AdamW), refusing a model without parameters with a message that says so: torch's own
    ("optimizer got an empty parameter list") names neither the model nor what to do."""
    make = optimizer or default_optimizer

    def checked(params: Any) -> torch.optim.Optimizer:
        params = list(params)
        if not params:
            raise ValueError(
                "the model that model_fn builds has no parameters: swap.plan plans training steps (forward, "
                "backward and an optimizer step on the parameters), so pass a model_fn whose model has some"
            )
        return make(params)

    return checked
