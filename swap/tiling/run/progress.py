"""Where ``swap.tiled``'s progress lines go: ``progress=True`` prints them to stderr, a callable receives
them, False drops them. One place, so the spatial and the token-tiled paths treat ``progress`` alike."""

from __future__ import annotations

import sys
from typing import Callable, Optional, Union

Progress = Union[bool, Callable[[str], None]]


def progress_sink(progress: Progress, tag: str) -> Optional[Callable[[str], None]]:
    """The function to call with each progress line (None: no progress), stderr lines prefixed by ``tag``."""
    if callable(progress):
        return progress
    if progress:
        return lambda msg: print(f"  [{tag}] {msg}", file=sys.stderr, flush=True)
    return None
