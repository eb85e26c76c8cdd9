"""How long the compute between two of the executor's hooks took: wall clock on the host, CUDA events on a GPU.

Note [Our own time is not the model's]
While profiling, the operator profiler (swap.runtime.auto.op_profiler) does Python bookkeeping after every operator,
inside the intervals these timers measure. A planned step runs without it, and the planner prices every
operator from these intervals (on a GPU the operator table is scaled to the measured forward: ``calibrated``
in swap.joint.ops), so the bookkeeping is handed to the timer (``exclude``) and taken out of its interval. On
the host that is exact. On a GPU the device idles for the bookkeeping only while it waits for the host (the
usual case under a Python profiler), so what is taken out depends on whether the device had caught up with
the host: ``stop`` asks whether the interval's start event has run yet (``Event.query``, no wait). If it has
not, the device was behind by more than the whole interval: everything the host did in it hid behind the
device's queue, and the device time is the kernels' alone, kept whole. If it has, the device ran the
interval while the host was still in it, idling whenever the host was busy, and the bookkeeping is taken
out. That can err low (bookkeeping that hid behind a short backlog is taken out too), never high.

The rule was "kept whole when the device measured the interval longer than the host did". A starved device
always measures it longer, by the last kernel's run after the host recorded the end event (tens of
microseconds for a convolution against a launch latency of a few), so the bookkeeping was almost never taken
out: on an H200 the small ResNet of ``make gpu-quick`` profiled 88.5 ms of compute for a 10.4 ms step (the
2026-11-28 lease, bench/gpu/quick_checks.py's profiled_time). ``interval_seconds`` is the rule.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def interval_seconds(device: float, ours: float, caught_up: bool) -> float:
    """The model's compute in an interval the device measured as ``device`` seconds, ``ours`` of the host's
    time in it being our bookkeeping; ``caught_up``: the device had begun the interval before the host ended it
    (Note [Our own time is not the model's])."""
    if not caught_up:  # the whole interval was queued before the device reached it: its kernels back to back
        return device
    return max(device - ours, 0.0)


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
        self.excluded = 0.0

    def exclude(self, seconds: float) -> None:
        """Host time in the current interval that is ours (Note [Our own time is not the model's])."""
        self.excluded += seconds

    def stop(self) -> Any:
        caught_up = self.begin.query()  # before the end event: has the device begun this interval yet?
        return (self.begin, self._event(), caught_up, self.excluded)

    def resolve(self, mark: Any) -> float:
        begin, end, caught_up, ours = mark
        end.synchronize()
        return interval_seconds(begin.elapsed_time(end) / 1e3, ours, caught_up)

    def done(self, mark: Any) -> bool:
        """Whether the device has passed ``mark``'s end (``resolve`` then makes the host wait for nothing)."""
        return mark[1].query()
