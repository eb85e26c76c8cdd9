"""vmalloc: a caching CUDA allocator that backs every tensor with fixed-size physical chunks.

Each allocation is a contiguous virtual range with whole chunks mapped into it (CUDA driver VMM), so any
free chunk can serve any request and physical memory cannot fragment externally.

    import torch, vmalloc
    torch.cuda.memory.change_current_allocator(vmalloc.allocator(capacity="16GiB"))

or, scoped (every thread's allocations on the device, backward's included):

    with vmalloc.use_mem_pool(vmalloc.mem_pool()):
        ...

The same core runs on host memory (``Arena(backend="host")``) and as a bookkeeping-only simulator
(``Arena(backend="sim")``), so everything but the driver calls is tested without a GPU.
"""

from __future__ import annotations

from ._C import BackendError, CaptureError, OutOfMemoryError, parse_size
from .arena import Arena
from .snapshot import dump_snapshot, snapshot_dict
from .torch_allocator import (
    adapter_status,
    allocator,
    configure,
    global_arena,
    installed,
    mem_pool,
    set_oom_handler,
    snapshot,
    stats,
    use_mem_pool,
)

__all__ = [
    "Arena",
    "BackendError",
    "CaptureError",
    "OutOfMemoryError",
    "adapter_status",
    "allocator",
    "configure",
    "dump_snapshot",
    "global_arena",
    "installed",
    "mem_pool",
    "parse_size",
    "set_oom_handler",
    "snapshot",
    "snapshot_dict",
    "stats",
    "use_mem_pool",
]
