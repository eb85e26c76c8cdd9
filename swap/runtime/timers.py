"""How long the compute between two of the executor's hooks took: wall clock on the host, CUDA events on a GPU."""

from __future__ import annotations

import time
from typing import Any

import torch


class HostStepTimer:
    """Wall-clock time between our hooks (the compute the profiled step did)."""

    def start(self) -> None:
        self.t = time.perf_counter()

    def stop(self) -> Any:
        return time.perf_counter() - self.t

    def resolve(self, mark: Any) -> float:
        return mark

    def done(self, mark: Any) -> bool:
        """Whether ``resolve(mark)`` can answer without waiting (always, on the host)."""
        return True


class CudaStepTimer:
    """CUDA events on the compute stream: the device time between our hooks, read at iteration end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _event(self) -> Any:
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(self.device))
        return e

    def start(self) -> None:
        self.begin = self._event()

    def stop(self) -> Any:
        return (self.begin, self._event())

    def resolve(self, mark: Any) -> float:
        begin, end = mark
        end.synchronize()
        return begin.elapsed_time(end) / 1e3

    def done(self, mark: Any) -> bool:
        """Whether the device has passed ``mark``'s end (``resolve`` then makes the host wait for nothing)."""
        return mark[1].query()
