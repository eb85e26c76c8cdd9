"""swap: train with saved activations beyond the device's memory, under a budget.

    with swap.SwapManager(budget="12GiB") as sm:
        for x, y in loader:
            loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
    print(sm.report())

Saved activations go to pinned host memory once the forward pass is done with them and come back ahead
of their backward use, following seed 001's window schedule. The scheduler (``make_schedule``) and the
simulator (``simulate``) are pure functions, usable without a GPU; ``python -m swap.plan`` predicts the
largest batch that fits a budget.
"""

from __future__ import annotations

from .budget import BudgetWarning
from .executor import WholeModelCompiled
from .manager import SwapManager
from .meter import LiveBytesMeter
from .report import SwapReport
from .scheduler import POLICIES, InfeasibleBudget, Schedule
from .scheduler import plan as make_schedule
from .sequence import Sequence
from .simulator import SimResult, choose_window, simulate

__all__ = [
    "POLICIES",
    "BudgetWarning",
    "InfeasibleBudget",
    "LiveBytesMeter",
    "Schedule",
    "Sequence",
    "SimResult",
    "SwapManager",
    "SwapReport",
    "WholeModelCompiled",
    "choose_window",
    "make_schedule",
    "simulate",
]
