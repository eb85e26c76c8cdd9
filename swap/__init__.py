"""swap: train with saved activations beyond the device's memory, under a budget.

    with swap.SwapManager(budget="12GiB") as sm:
        for x, y in loader:
            loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
    print(sm.report())

Saved activations go to pinned host memory once the forward pass is done with them and come back ahead
of their backward use, under a window schedule: a look-ahead measured in bytes says what to fetch back, and
swap-outs are chosen so the budget always holds. Before buying memory, ``swap.plan(model_fn, batch_fn,
budget="24GiB", device="h100-pcie")`` (or ``python -m swap``) predicts the largest batch of your model that
fits, per policy and per strategy, and its speed, from a capture of its training step on the meta device.
When one activation alone is larger than the device, ``swap.tiled(model, budget=...)`` runs its
convolution chains (or a causal LM's head and loss) tile by tile. The scheduler (``make_schedule``,
``schedule_for``) and the simulator (``simulate``) are pure functions, usable without a GPU. ARCHITECTURE.md
at the repository's root maps the package.

Note [Policy and strategy]
Two words, two things:
- A **policy** is how the runtime moves saved tensors between the device and the host: ``window`` (a
  look-ahead in bytes; ``window="auto"`` chooses its size by simulation, and is still the window policy),
  ``fixed_distance`` (TFLMS's step distances), ``all`` (vDNN: everything out, back one step ahead) and
  ``none``. ``swap.POLICIES``; the scheduler's ``plan(seq, budget, window, policy)`` makes a policy's schedule.
- A **strategy** is a whole keep / swap / recompute plan for a model: which tensors stay, which are recomputed
  (checkpointed regions, rebuilds) and which policy swaps the rest. The baselines are named strategies
  (``checkpoint``, ``selective``, ``checkpoint_window``, ...; the swap-only ones are named after their policy:
  ``window``, ``fixed_distance``, ``all``, and ``none`` keeps everything), and ``auto`` is the joint search,
  never slower than any baseline. ``swap.STRATEGIES``; ``swap.joint`` holds them.
So "auto" is a strategy and never a policy: ``SwapManager(strategy="auto")`` (the default) searches, and
``SwapManager(policy="window")`` swaps only, by the window policy; ``SwapManager(policy="auto")``, the old
spelling, still means ``strategy="auto"`` and warns. ``swap.plan`` compares the policies (``policies=``,
``--policies``) and the strategies (``strategies=``, ``--strategies``) side by side.
"""

# No ``from __future__ import annotations`` here: this module annotates nothing, and the import would leave a
# name ``swap.annotations`` in the public namespace beside the package's own names.
from .forecast import Plan, plan  # Note [swap.plan is a function]
from .joint.search import STRATEGIES
from .runtime.activations.executor import WholeModelCompiled
from .runtime.activations.signals import BudgetWarning
from .runtime.machine.host_pool import PinningUnavailable
from .runtime.machine.meter import LiveBytesMeter
from .runtime.manager import SwapManager
from .runtime.model_state import (
    fsdp2,  # swap.fsdp2: FSDP2 units offloaded by a budget, their host steps, clipping across ranks
)
from .runtime.report import SwapReport
from .schedule.model_state import HostMemoryError, ModelStateDoesNotFit, ModelStatePolicy
from .schedule.scheduler import POLICIES, InfeasibleBudget, Schedule
from .schedule.scheduler import plan as make_schedule
from .schedule.sequence import Sequence
from .schedule.simulator import Scheduled, SimResult, choose_window, schedule_for, simulate
from .tiling.plan.choose import TilePlan, TilingInfeasible
from .tiling.plan.head import HeadInfeasible
from .tiling.run.entry import tiled
from .tiling.run.head import TiledCausalLM, tiled_cross_entropy
from .tiling.run.model import TiledModel

__all__ = [
    "POLICIES",
    "STRATEGIES",
    "BudgetWarning",
    "HeadInfeasible",
    "HostMemoryError",
    "InfeasibleBudget",
    "LiveBytesMeter",
    "ModelStateDoesNotFit",
    "ModelStatePolicy",
    "PinningUnavailable",
    "Plan",
    "Schedule",
    "Scheduled",
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
    "fsdp2",
    "make_schedule",
    "plan",
    "schedule_for",
    "simulate",
    "tiled",
    "tiled_cross_entropy",
]
