"""The report's data, read from the runtime's objects (``SwapManager.report`` turns it into a ``SwapReport``)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..schedule.budget import min_budget
from .activations.executor import DECLINED, PLANNED, PROFILE, Counters, Executor
from .activations.plan_book import PlanBook
from .activations.recompute import RecomputeHooks
from .auto.joint import JointRuntime
from .report import SwapReport


def status(policy: str, executor: Optional[Executor]) -> str:
    if policy == "none":
        return "declined (policy 'none')"
    if executor is None or (executor.iteration == 0 and executor.counters.iterations == 0):
        return "not started"
    return {PROFILE: "profiling", PLANNED: "planned", DECLINED: "declined"}.get(executor.mode, "re-profiling")


def snapshot(policy: str, device: torch.device, budget: int, window: Optional[int], executor: Optional[Executor],
             joint: Optional[JointRuntime], recompute: Optional[RecomputeHooks]) -> dict[str, Any]:  # fmt: skip
    """The report's keys (``SwapReport`` lists them) for a manager with these settings and runtime objects;
    ``window``: the window the schedule was made with; ``executor`` None: nothing ran (not entered yet, or
    policy 'none')."""
    ex = executor
    base = {
        "status": status(policy, ex), "policy": policy, "device": str(device),
        "budget_bytes": budget, "window_bytes": window,
    }  # fmt: skip
    if ex is None:
        return {**base, **vars(Counters()), **PlanBook().counts(), "peak_device_bytes": None,
                "declined": policy == "none", "memory_source": None, "peak_measured_inside_ops": None}  # fmt: skip
    c, life, memory = ex.counters, ex.lifecycle, ex.memory
    seq = life.sequence or life.previous
    return {
        **base,
        "iterations": c.iterations,
        "swapped_out_bytes": c.swapped_out_bytes,
        "swapped_in_bytes": c.swapped_in_bytes,
        "demand_fetches": c.demand_fetches,
        "stall_seconds": c.stall_seconds,
        "peak_device_bytes": memory.peak if c.iterations or ex.iteration else None,
        "entry_peak_bytes": ex.entry_peak,  # Note [The memory before the first iteration] (activations.executor)
        "replans": c.replans,
        "profiling_iterations": c.profiling_iterations,
        "plan_events": list(c.plan_events),
        **life.book.counts(),  # Note [Plans by input shape]
        "overruns": memory.over_budget,  # Note [What the over-budget count counts] (swap.runtime.machine.memory)
        "evictions": c.evictions,
        "declined": ex.mode == DECLINED,
        "planned_peak_bytes": ex.schedule.peak if ex.schedule is not None else None,
        "no_swap_peak_bytes": (life.unswapped_peak if life.unswapped_peak is not None
                               else seq.no_swap_peak() if seq is not None else None),  # fmt: skip
        "min_budget_bytes": min_budget(seq) if seq is not None else None,
        "variables_per_iteration": len(seq.sizes) if seq is not None else None,
        "host_pool_bytes": ex.pool.reserved,
        "host_pool_peak_used_bytes": ex.pool.peak_used,
        "memory_source": memory.name,
        "peak_measured_inside_ops": memory.sees_inside_ops,
        **(joint.snapshot(seq, ex.schedule if ex.mode == PLANNED else None) if joint else {}),
        **({"rebuilds": recompute.rebuilt, "rebuilt_bytes": recompute.rebuilt_bytes}
           if recompute is not None else {}),  # fmt: skip
    }


def report(data: dict[str, Any], notes: list[str]) -> SwapReport:
    """``data`` (a snapshot) with the manager's ``notes``, and the notes that the data itself calls for."""
    notes = list(notes)
    if data["status"] == "not started":
        notes.insert(0, "not started: no training iteration has run inside the manager yet")
    if data.get("peak_measured_inside_ops") is False:
        notes.append(
            "on CPU the budget is measured as live tensor bytes between operators (swap.LiveBytesMeter): "
            "memory an operator allocates and frees inside itself is not seen; on a GPU the allocator's "
            "own peak is measured, which is the truth"
        )
    data["notes"] = notes
    return SwapReport(data)
