"""Late copies on purpose: a sleep kernel queued on the swap engine's copy stream before every copy.

Note [Late copies]
The CPU engine blocks the host at every wait, so no CPU test can show a missing device-side wait or a fence on
the wrong stream (../shared/notes/model-state-review.md, row 21): on a GPU the copies are usually early enough
that the missing wait goes unseen. ``install(cycles)`` wraps ``CudaEngine._copy`` so that each copy's stream
first runs ``torch.cuda._sleep(cycles)``: every copy lands late, whatever waits on it must wait on the device,
and a result that is still bitwise equal to the unswapped run's says the orderings hold. It changes nothing
but timing, and only in the process that installs it (the lease's lag phases, tests/gpu/swap_worker.py --lag).
"""

from __future__ import annotations

from typing import Any, Callable

DEFAULT_CYCLES = 1_000_000  # about 0.5 ms at the H100's and H200's ~1.8-2 GHz


def install(cycles: int = DEFAULT_CYCLES) -> Callable[[], None]:
    """Delays every copy of ``swap.runtime.machine.engines.CudaEngine`` by ``cycles`` GPU clock cycles; returns the
    undo. Raises RuntimeError without CUDA (the CPU engine has no streams to delay)."""
    import torch

    from swap.runtime.machine import engines

    if not torch.cuda.is_available():
        raise RuntimeError("late copies need CUDA: the CPU engine blocks at every wait, so there is nothing to delay")
    original = engines.CudaEngine._copy

    def late(self: Any, stream: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)  # queued before the copy's own waits and the copy itself
        return original(self, stream, *args, **kwargs)

    engines.CudaEngine._copy = late  # type: ignore[method-assign]

    def undo() -> None:
        engines.CudaEngine._copy = original  # type: ignore[method-assign]

    return undo
