"""The device peak of one batch size: without swapping, and under a budget with the swap runtime's plan.

``swap.plan`` searches batch sizes; ``predict_peak`` answers for one, which is what a measurement can be
held against (bench/plan_vs_reality.py trains the model under ``SwapManager`` and compares).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from ..capture import capture
from ..devices import DeviceProfile
from ..devices import profile as device_profile
from ..schedule.simulator import schedule_for
from ..units import Size, parse_size
from .from_trace import sequence_from_trace


@dataclass
class PeakPrediction:
    batch: int
    no_swap_peak: int  # bytes of live tensors at the peak of a steady-state step, nothing swapped
    floor: int  # the least budget any schedule can meet (the largest single step's working set)
    budget: Optional[int] = None
    policy: Optional[str] = None
    planned_peak: Optional[int] = None  # the schedule's peak under ``budget``
    window: Optional[int] = None
    swapped_bytes: int = 0  # bytes the schedule copies to the host per step


def predict_peak(
    model_fn: Callable[[], torch.nn.Module],
    batch_fn: Callable[[int], Any],
    loss_fn: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None,
    *,
    batch: int,
    budget: Optional[Size] = None,
    policy: str = "window",
    device: Union[str, DeviceProfile] = "h100-pcie",
    optimizer: Optional[Callable[[Any], torch.optim.Optimizer]] = None,
    dtype: Optional[torch.dtype] = None,
    min_bytes: Size = "1MiB",
    target: str = "cuda",
) -> PeakPrediction:
    """Captures ``batch`` samples' training step (arguments as ``swap.plan``) and predicts its peak; with a
    ``budget``, also the peak of ``policy``'s schedule under it (``swap.InfeasibleBudget`` if none fits)."""
    dev = device if isinstance(device, DeviceProfile) else device_profile(device)
    trace = capture(model_fn, batch_fn, batch, loss_fn, optimizer=optimizer, dtype=dtype, target=target)
    seq = sequence_from_trace(trace, min_bytes=parse_size(min_bytes, "min_bytes", minimum=1) if min_bytes else 0)
    floor = seq.step_floor()
    out = PeakPrediction(batch, seq.no_swap_peak(), floor)
    if budget is None:
        return out
    out.budget, out.policy = parse_size(budget, "budget", minimum=1), policy
    if out.no_swap_peak <= out.budget:  # the runtime declines to swap what fits
        out.planned_peak = out.no_swap_peak
        return out
    out.window, sched, _ = schedule_for(seq, out.budget, policy, dev.h2d_bandwidth, dev.d2h_bandwidth)
    out.planned_peak, out.swapped_bytes = sched.peak, sched.bytes_out(seq)
    return out
