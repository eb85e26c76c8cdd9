"""Out-of-memory as trainers recognize it.

``accelerate.find_executable_batch_size`` retries with a smaller batch only on a ``RuntimeError`` whose
single argument contains " out of memory." (``accelerate.utils.memory.should_reduce_batch_size``). Two
errors mean exactly that here and are neither: ``swap.InfeasibleBudget`` (a ValueError: no schedule holds
this batch within the budget) and ``vmalloc.OutOfMemoryError`` as ``vmalloc.Arena`` raises it (a
MemoryError). ``torch_oom`` re-raises both as ``torch.OutOfMemoryError("CUDA out of memory. ...")``, the
error PyTorch itself raises when CUDA memory runs out, chained to the original. It must sit inside the
function accelerate retries, so Hugging Face ``Trainer(auto_find_batch_size=True)``, which retries its own
inner loop, does not see the conversion.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..schedule.scheduler import InfeasibleBudget

PREFIX = "CUDA out of memory. "


def _vmalloc_oom() -> tuple[type[BaseException], ...]:
    try:
        from vmalloc import OutOfMemoryError
    except ImportError:  # the compiled core is not built: only swap's own error can occur
        return ()
    return (OutOfMemoryError,)


@contextlib.contextmanager
def torch_oom() -> Iterator[None]:
    """Inside it, running out of device memory under swap or vmalloc raises ``torch.OutOfMemoryError``::

        @find_executable_batch_size(starting_batch_size=256)
        def train(batch_size):
            with swap.integrations.oom.torch_oom(), swap.SwapManager(budget="24GiB"):
                ...
    """
    try:
        yield
    except (InfeasibleBudget, *_vmalloc_oom()) as e:
        message = str(e)
        raise torch.OutOfMemoryError(message if PREFIX.strip() in message else PREFIX + message) from e
