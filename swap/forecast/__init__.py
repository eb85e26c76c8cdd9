"""The forecast for a user's model: ``swap.plan(model_fn, batch_fn, ...) -> swap.Plan``, how large a batch of
the model fits a GPU with swapping, and how fast it runs, before anything runs on the GPU; ``python -m swap``
(or ``python -m swap.plan``) is its command line (``swap.cli``).

``planner`` (``plan``) and ``predict`` (``predict_peak``) capture the training step (``swap.capture``) and plan
it: ``from_trace`` and ``ops_from_trace`` turn a trace into the scheduler's sequence and the joint search's
operator table, ``pricing`` prices operators on the device profiles (``swap.devices``), ``strategies``
compares the keep / swap / recompute strategies (``swap.joint``), ``replay/`` replays a trace against an
allocator, ``result`` is ``swap.Plan``, and ``zoo`` the built-in models of the command line and benchmarks."""

from __future__ import annotations

from .planner import plan
from .predict import PeakPrediction, predict_peak
from .result import Plan, PolicyResult

__all__ = ["PeakPrediction", "Plan", "PolicyResult", "plan", "predict_peak"]
