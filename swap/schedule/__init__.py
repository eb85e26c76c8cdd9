"""The schedule: which saved tensors leave the device when, and when they come back, for one iteration.

``sequence`` (the iteration as the scheduler sees it), ``scheduler`` (``plan``: a policy's schedule under a
budget), ``simulator`` (the iteration replayed on a compute stream and two copy engines; ``choose_window``;
``schedule_for``, the one place that says how a policy gets its schedule) and ``budget`` (each step's floor,
the smallest feasible budget, ``InfeasibleBudget``) and ``model_state`` (parameters in buckets, where each
lives and is updated: ``plan_model_state``). Pure: no torch, no CUDA, no I/O, so the runtime, the
joint search, the forecast and the tests all drive it directly. Imports only ``swap.units``.
"""

from __future__ import annotations

from .budget import InfeasibleBudget
from .model_state import Bucket, ModelStateDoesNotFit, ModelStatePlan, Placement, UpdateSite, plan_model_state
from .scheduler import POLICIES, Schedule, plan
from .sequence import Sequence
from .simulator import Scheduled, SimResult, choose_window, schedule_for, simulate

__all__ = [
    "POLICIES", "Bucket", "InfeasibleBudget", "ModelStateDoesNotFit", "ModelStatePlan", "Placement", "UpdateSite",
    "plan_model_state", "Schedule", "Scheduled", "Sequence", "SimResult", "choose_window", "plan",
    "schedule_for", "simulate",
]  # fmt: skip
