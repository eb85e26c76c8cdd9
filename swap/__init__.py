"""swap: train with saved activations beyond the device's memory, under a budget.

    with swap.SwapManager(budget="12GiB") as sm:
        for x, y in loader:
            loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
    print(sm.report())

Saved activations go to pinned host memory once the forward pass is done with them and come back ahead
of their backward use, following seed 001's window schedule. Before buying memory, ``swap.plan(model_fn,
batch_fn, budget="24GiB", device="h100-pcie")`` (or ``python -m swap.plan``) predicts the largest batch of
your model that fits, per policy, and its speed, from a capture of its training step on the meta device.
When one activation alone is larger than the device, ``swap.tiled(model, budget=...)`` runs its
convolution chains (or a causal LM's head and loss) tile by tile (seed 000). The scheduler
(``make_schedule``) and the simulator (``simulate``) are pure functions, usable without a GPU.
"""

from __future__ import annotations

from .planning import Plan, plan  # Note [swap.plan is a function]
from .planning.scheduler import POLICIES, InfeasibleBudget, Schedule
from .planning.scheduler import plan as make_schedule
from .planning.sequence import Sequence
from .planning.simulator import SimResult, choose_window, simulate
from .planning.tiling.choose import TilePlan, TilingInfeasible
from .planning.tiling.head import HeadInfeasible
from .runtime.executor import WholeModelCompiled
from .runtime.host_pool import PinningUnavailable
from .runtime.manager import SwapManager
from .runtime.meter import LiveBytesMeter
from .runtime.report import SwapReport
from .runtime.signals import BudgetWarning
from .runtime.tiling.entry import tiled
from .runtime.tiling.head import TiledCausalLM, tiled_cross_entropy
from .runtime.tiling.model import TiledModel

__all__ = [
    "POLICIES",
    "BudgetWarning",
    "HeadInfeasible",
    "InfeasibleBudget",
    "LiveBytesMeter",
    "PinningUnavailable",
    "Plan",
    "Schedule",
    "Sequence",
    "SimResult",
    "SwapManager",
    "SwapReport",
    "TilePlan",
    "TiledCausalLM",
    "TiledModel",
    "TilingInfeasible",
    "WholeModelCompiled",
    "choose_window",
    "make_schedule",
    "plan",
    "simulate",
    "tiled",
    "tiled_cross_entropy",
]
