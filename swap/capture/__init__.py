"""Training steps of any model, captured on the meta device as allocation traces (what ``swap.plan`` plans
with): ``capture`` records them, ``LinearTrace`` scales one to any batch size. The scheduler's view of a trace,
and a trace as the swap runtime would run it, are the forecast's (swap.forecast.from_trace)."""

from __future__ import annotations

from .scaling import LinearTrace
from .step import CaptureError, build_model, capture, default_loss, default_optimizer, make_batch
from .trace import (
    ALLOC,
    FORMAT_VERSION,
    FREE,
    ITER_BEGIN,
    ITER_END,
    OP,
    PHASE,
    PHASES,
    PRECISIONS,
    SAVE,
    TAG,
    TAGS,
    UNREF,
    USE,
    Trace,
    TraceBuilder,
    live_peak,
    summary,
)  # fmt: skip

__all__ = [
    "ALLOC", "FORMAT_VERSION", "FREE", "ITER_BEGIN", "ITER_END", "OP", "PHASE", "PHASES", "PRECISIONS", "SAVE", "TAG",
    "TAGS", "UNREF", "USE",
    "CaptureError", "LinearTrace", "Trace", "TraceBuilder", "build_model", "capture", "default_loss",
    "default_optimizer", "live_peak", "make_batch", "summary",
]  # fmt: skip
