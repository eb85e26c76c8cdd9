"""The schedule: which saved tensors leave the device when, and when they come back, for one iteration.

``sequence`` (the iteration as the scheduler sees it), ``scheduler`` (``plan``: a policy's schedule under a
budget), ``wanted`` (the scheduler's prefetch queue), ``simulator`` (the iteration replayed on a compute stream
and two copy engines; ``choose_window``; ``schedule_for``, the one place that says how a policy gets its
schedule), ``budget`` (each step's floor, the smallest feasible budget, ``InfeasibleBudget``), and
``model_state/`` (the one model-state plan of the forecast and the runtime: buckets, bytes, placements, the
simulated chooser, FSDP2 units, ``ModelStatePolicy``). Pure: no CUDA, no I/O (torch only to name a compute dtype),
so the runtime, the joint search, the forecast and the tests all drive it directly. Imports only ``swap.units``.
"""

from __future__ import annotations

from .budget import InfeasibleBudget
from .model_state import (
    Bucket,
    BucketUses,
    ModelStateChoice,
    ModelStateDoesNotFit,
    ModelStatePlan,
    ModelStatePrices,
    ModelStateSim,
    Placement,
    UpdateSite,
    choose_model_state,
    plan_model_state,
    simulate_model_state,
    with_weights,
)
from .scheduler import POLICIES, Schedule, plan
from .sequence import Sequence
from .simulator import Scheduled, SimResult, choose_window, schedule_for, simulate

__all__ = [
    "POLICIES", "Bucket", "BucketUses", "InfeasibleBudget", "ModelStateChoice", "ModelStateDoesNotFit",
    "ModelStatePlan", "ModelStatePrices", "ModelStateSim", "Placement", "UpdateSite", "choose_model_state",
    "plan_model_state", "simulate_model_state", "with_weights", "Schedule", "Scheduled", "Sequence", "SimResult",
    "choose_window", "plan", "schedule_for", "simulate",
]  # fmt: skip
