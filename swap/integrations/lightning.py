"""PyTorch Lightning: ``SwapCallback`` runs training inside a ``swap.SwapManager``.

Where you call ``trainer.fit`` yourself, ``with swap.SwapManager(...): trainer.fit(model)`` does the same;
the callback is for setups where something else calls it (LightningCLI, a config-driven launcher)::

    trainer = lightning.Trainer(callbacks=[SwapCallback(budget="24GiB")])
    trainer.fit(model)
    print(trainer.callbacks[0].report)      # or the callback object you kept

The manager is built and entered when training starts (after the sanity-check validation, which saves nothing
for backward, and once Lightning has moved the module to its device: the manager swaps ``pl_module.device``
unless ``device=`` says otherwise), and left when training ends or fails, so the hooks never outlive the run.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import lightning

from ..runtime.manager import SwapManager
from ..runtime.report import SwapReport


class SwapCallback(lightning.Callback):
    """``SwapCallback(**kwargs)``: the keyword arguments of ``swap.SwapManager`` (budget, window, policy, ...),
    for a manager built at each ``on_train_start`` on the module's device; or ``SwapCallback(manager=...)``,
    a manager you built (used as it is)."""

    def __init__(self, manager: Optional[SwapManager] = None, **kwargs: Any) -> None:
        if manager is not None and kwargs:
            raise ValueError("pass either a SwapManager or its keyword arguments, not both")
        try:
            inspect.signature(SwapManager).bind(**kwargs)  # a misspelt keyword fails here, not at train start
        except TypeError as e:
            raise TypeError(f"SwapCallback takes swap.SwapManager's keyword arguments: {e}") from None
        self._kwargs = None if manager is not None else kwargs
        self.manager: Optional[SwapManager] = manager  # built at train start from the keyword arguments
        self.report: Optional[SwapReport] = None
        self._entered = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._kwargs is not None:
            self.manager = SwapManager(**{"device": pl_module.device, **self._kwargs})
        self.manager.__enter__()
        self._entered = True

    def _leave(self, exc: Optional[BaseException]) -> None:
        if self._entered:
            self._entered = False
            self.manager.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
            self.report = self.manager.report()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._leave(None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._leave(exception)
