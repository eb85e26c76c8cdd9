"""``swap.plan(model_fn, batch_fn, ...) -> swap.Plan``: how large a batch of your model fits your GPU with
swapping, and how fast it runs; ``python -m swap.plan`` is its command line (``swap.planning.cli``)."""

from __future__ import annotations

from .planner import plan
from .predict import PeakPrediction, predict_peak
from .result import Plan, PolicyResult

__all__ = ["PeakPrediction", "Plan", "PolicyResult", "plan", "predict_peak"]
