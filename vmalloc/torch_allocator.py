"""vmalloc as PyTorch's CUDA allocator: globally (change_current_allocator) or scoped (MemPool).

Note [Global configuration]
The global arenas (one per device) are made on the first CUDA allocation, from the options given to
``allocator(**options)`` / ``configure(**options)``, else from ``VMALLOC_CONF`` (e.g.
``chunk_size=2MiB,capacity=16GiB``). torch.cuda.memory_stats() does not work with pluggable allocators, so
``vmalloc.stats(device)`` and ``vmalloc.snapshot(device)`` report on them instead.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Optional

from . import _C
from .snapshot import snapshot_dict

_ALLOCATOR: Any = None

# torch hook setter -> our C entry point; wired where the installed torch has the setter.
_HOOKS = {
    "set_init_fn": "vmalloc_init",
    "set_reset_fn": "vmalloc_empty_cache",
    "set_memory_fraction_fn": "vmalloc_set_memory_fraction",
    "set_record_stream_fn": "vmalloc_record_stream",
}


def configure(**options: Any) -> None:
    """Sets the global arenas' options (backend, capacity, chunk_size, small_max, history, eager_growth,
    devices) before first use.

    Options not given keep their ``VMALLOC_CONF`` value. Raises ValueError for a bad option (checked now),
    RuntimeError once an arena exists.
    """
    known = {"backend", "capacity", "chunk_size", "small_max", "history", "eager_growth", "devices"}
    unknown = set(options) - known
    if unknown:
        raise TypeError(f"unknown vmalloc option(s) {sorted(unknown)}: use {', '.join(sorted(known))}")
    _C.configure(**options)


def allocator(**options: Any) -> Any:
    """A ``torch.cuda.memory.CUDAPluggableAllocator`` backed by vmalloc, for ``change_current_allocator``.

    Install it before the first CUDA allocation. ``options`` are those of ``configure``. The optional
    hooks the installed torch offers (empty_cache, memory fraction, record_stream, init) are wired.
    """
    global _ALLOCATOR
    import torch

    if options:
        configure(**options)
    if _ALLOCATOR is not None:
        return _ALLOCATOR
    if not hasattr(torch._C, "_cuda_customAllocator"):
        raise RuntimeError(
            f"vmalloc.allocator() needs a CUDA build of PyTorch; this one ({torch.__version__}) has none. "
            "Without a GPU, use vmalloc.Arena(backend='host') or backend='sim'."
        )
    path = _C.library_path()
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "vmalloc_malloc", "vmalloc_free")
    lib = ctypes.CDLL(path)
    raw = alloc.allocator()
    for setter, symbol in _HOOKS.items():
        if hasattr(raw, setter):
            getattr(raw, setter)(ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value)
    _ALLOCATOR = alloc
    return alloc


def mem_pool(**options: Any) -> Any:
    """A ``torch.cuda.MemPool`` whose memory comes from vmalloc, for ``torch.cuda.use_mem_pool(pool)``."""
    import torch

    return torch.cuda.MemPool(allocator(**options).allocator())


def _arena(device: int) -> Optional[Any]:
    return _C.existing_global_arena(device)


def stats(device: int = 0) -> dict[str, int]:
    """Statistics of the global arena of ``device`` (torch.cuda.memory_stats key names); {} before first use."""
    arena = _arena(device)
    return arena.stats() if arena is not None else {}


def snapshot(device: int = 0) -> dict[str, Any]:
    """The global arena's state in PyTorch's memory-snapshot layout; empty before first use."""
    arena = _arena(device)
    if arena is None:
        return {"segments": [], "device_traces": [[] for _ in range(device + 1)], "allocator_settings": {}}
    return snapshot_dict(arena)


def set_oom_handler(fn: Optional[Callable[[int], bool]], device: int = 0) -> None:
    """Calls ``fn(nbytes)`` before the global arena of ``device`` fails an allocation; True means it freed
    memory and the allocation is tried once more. None removes the handler."""
    _C.global_arena(device).set_oom_handler(fn)
