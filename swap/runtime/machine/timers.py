"""How long the compute between two of the executor's hooks took: wall clock on the host, CUDA events on a GPU.

Note [Our own time is not the model's]
While profiling, the operator profiler (swap.runtime.auto.op_profiler) does Python bookkeeping after every operator,
inside the intervals these timers measure. A planned step runs without it, and the planner prices every
operator from these intervals (on a GPU the operator table is scaled to the measured forward: ``calibrated``
in swap.joint.ops), so the bookkeeping is handed to the timer (``exclude``) and taken out of its interval. On
the host that is exact. On a GPU the device idles for the bookkeeping only while it waits for the host (the
usual case under a Python profiler): the bookkeeping is taken out of an interval the device measured no
longer than the host did; one it measured longer (the device behind, its own work the bottleneck) is kept
whole. Between the two the subtraction can err low, never high.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class HostStepTimer:
    """Wall-clock time between our hooks (the compute the profiled step did)."""

    excluded = 0.0  # ours, in the current interval

    def start(self) -> None:
        self.t = time.perf_counter()
        self.excluded = 0.0

    def exclude(self, seconds: float) -> None:
        """Host time in the current interval that is ours, not the model's (Note [Our own time is not the
        model's])."""
        self.excluded += seconds

    def stop(self) -> Any:
        return max(0.0, time.perf_counter() - self.t - self.excluded)

    def resolve(self, mark: Any) -> float:
        return mark

    def done(self, mark: Any) -> bool:
        """Whether ``resolve(mark)`` can answer without waiting (always, on the host)."""
        return True


class CudaStepTimer:
    """CUDA events on the compute stream: the device time between our hooks, read at iteration end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.excluded = 0.0  # ours, in the current interval

    def _event(self) -> Any:
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(self.device))
        return e

    def start(self) -> None:
        self.begin = self._event()
        self.t = time.perf_counter()
        self.excluded = 0.0

    def exclude(self, seconds: float) -> None:
        """Host time in the current interval that is ours (Note [Our own time is not the model's])."""
        self.excluded += seconds

    def stop(self) -> Any:
        return (self.begin, self._event(), time.perf_counter() - self.t, self.excluded)

    def resolve(self, mark: Any) -> float:
        begin, end, host, ours = mark
        end.synchronize()
        device = begin.elapsed_time(end) / 1e3
        if device > host:  # the device was behind the host: the bookkeeping hid behind its work
            return device
        return max(device - ours, 0.0)  # Note [Our own time is not the model's]

    def done(self, mark: Any) -> bool:
        """Whether the device has passed ``mark``'s end (``resolve`` then makes the host wait for nothing)."""
        return mark[1].query()
