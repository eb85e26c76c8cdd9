"""A measured training run's context: an independent LiveBytesMeter (counting what is live already, its window
restarted) and a SwapManager, each optional, entered in that order (the meter sees everything the manager does)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional


@contextlib.contextmanager
def metered(meter: Optional[Any] = None, manager: Optional[Any] = None) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if meter is not None:
            stack.enter_context(meter.track_existing())
            meter.reset_window()
        if manager is not None:
            stack.enter_context(manager)
        yield
