"""PyTorch Lightning: ``SwapCallback`` runs training inside a ``swap.SwapManager``.

Where you call ``trainer.fit`` yourself, ``with swap.SwapManager(...): trainer.fit(model)`` does the same;
the callback is for setups where something else calls it (LightningCLI, a config-driven launcher)::

    trainer = lightning.Trainer(callbacks=[SwapCallback(budget="24GiB")])
    trainer.fit(model)
    print(trainer.callbacks[0].report)      # or the callback object you kept

The manager is entered when training starts (after the sanity-check validation, which saves nothing for
backward) and left when it ends or fails, so the hooks never outlive the run.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning

from ..manager import SwapManager
from ..report import SwapReport


class SwapCallback(lightning.Callback):
    """``SwapCallback(**kwargs)``: the keyword arguments of ``swap.SwapManager`` (budget, window, policy, ...),
    or ``SwapCallback(manager=SwapManager(...))``."""

    def __init__(self, manager: Optional[SwapManager] = None, **kwargs: Any) -> None:
        if manager is not None and kwargs:
            raise ValueError("pass either a SwapManager or its keyword arguments, not both")
        self.manager = manager if manager is not None else SwapManager(**kwargs)
        self.report: Optional[SwapReport] = None
        self._entered = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
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
