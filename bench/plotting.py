"""Matplotlib without a display, and the one way the benchmarks write a figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> Path:
    """Lays out, writes (PNG, 120 dpi) and closes ``fig``."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path
