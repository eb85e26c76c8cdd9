"""vmalloc as PyTorch's CUDA allocator: globally (change_current_allocator) or scoped (MemPool).

Note [Global configuration]
The global arenas (one per device) are made on the first CUDA allocation, from the options given to
``allocator(**options)`` / ``configure(**options)``, else from ``VMALLOC_CONF`` (e.g.
``chunk_size=2MiB,capacity=16GiB``).

Note [Two ways into torch]
``allocator()`` returns the torch adapter (vmalloc/torch_adapter.py: ``torch.cuda.memory_stats``,
``torch.cuda.OutOfMemoryError``, ``cudnn.benchmark``, ``record_stream``... work) when it can be built for the
installed torch. Otherwise it refuses, unless the caller opts into torch's plain ``CUDAPluggableAllocator``
over vmalloc's C entry points (Note [No silent fallback]); then ``vmalloc.stats()`` and
``vmalloc.snapshot()`` are the way to read the arena.

Note [No silent fallback]
In global mode, torch's plain pluggable allocator has no Python setter for the record_stream hook (torch 2.4
to 2.14), so ``Tensor.record_stream()`` is a no-op: a block that a side stream or NCCL still reads is handed
out again as soon as the tensor dies on its own stream, a use-after-free nothing reports. Memory statistics
(``torch.cuda.memory_stats()``) and ``cudnn.benchmark=True`` raise. Such a fallback must never be entered by
accident (a missing compiler is enough to lose the adapter), so ``allocator()`` raises instead, naming the
reason and the fix, unless the fallback is asked for by ``allocator(fallback=True)`` or
``VMALLOC_ALLOW_FALLBACK=1``; then it warns, saying what breaks. ``mem_pool()`` needs no such consent: in
MemPool mode torch's own caching allocator stays current and keeps record_stream and its statistics, and
vmalloc only serves its segments; what the adapter adds there is that a CUDA graph captured inside the scope
keeps its own private pool, so ``mem_pool()`` warns that without it graphs must be captured outside the scope.

Note [MemPool mode routes every thread]
``torch.cuda.use_mem_pool(pool)`` routes only the calling thread's allocations, so backward's allocations,
made on autograd's device threads, would bypass the pool. ``vmalloc.use_mem_pool(pool)`` routes every
allocation on the device (any thread, any stream that is not being captured into a CUDA graph: Note [Pool
scopes leave captures alone] in csrc/torch/adapter.cpp) to the pool while it is active. In this mode torch's
caching allocator calls vmalloc while holding its own lock, so vmalloc never runs its OOM handler there
(Note [OOM handler and torch's allocator lock] in csrc/torch/adapter.cpp); the swap runtime measures through
torch's statistics instead of the arena's (swap/runtime/memory.py).

Note [What a pool scope costs]
torch's caching allocator (2.11, and the releases before pytorch#175374 separated pools from captures)
treats any open allocate-to-pool scope as if a CUDA graph capture were under way, for every stream and
thread:
  - a block freed after ``Tensor.record_stream`` is neither reused nor returned until the scope ends (its
    end-of-life events are deferred), and blocks waiting on events recorded before the scope are not
    recycled during it (process_events is skipped). A loop that calls record_stream every iteration grows
    by those blocks every iteration inside the scope. swap's copy engine does not call it (Note [Copies
    without record_stream] in swap/runtime/engines.py);
  - when the pool cannot serve an allocation, torch raises ``torch.cuda.OutOfMemoryError`` without
    releasing cached blocks and retrying (and no release ever gives the pool's own cached blocks back to
    vmalloc for a retry);
  - ``torch.cuda.empty_cache()`` inside the scope releases nothing of torch's default pools (releases
    before 2.8 failed an internal assertion instead); ``vmalloc.global_arena(device).empty_cache()`` still
    returns what vmalloc itself caches.
These are torch's, and ``torch.cuda.empty_cache`` / ``record_stream`` are torch's own functions, so
``use_mem_pool`` cannot intercept them; it says so in its docstring. Open the scope around whole training
steps, as a global allocator would be. Where these limits do not suit, install vmalloc globally
(``torch.cuda.memory.change_current_allocator(vmalloc.allocator())``), which has none of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import warnings
from collections.abc import Iterator
from typing import Any, Callable, Optional

from . import _C, torch_adapter
from .snapshot import snapshot_dict

_ALLOCATOR: Any = None  # the global-mode allocator (a torch.cuda.memory._CUDAAllocator)
_POOL_ALLOCATOR: Any = None  # the allocator MemPools are made with
_ADAPTER: Any = None  # the adapter module, when in use

# torch hook setter -> our C entry point, wired in plain mode where the installed torch exposes the setter to
# Python (torch 2.4 to 2.14 expose none: their hooks are reached only from C++, hence the adapter). No init
# hook: each device's arena is made by its first allocation, as in the adapter.
_HOOKS = {
    "set_reset_fn": "vmalloc_empty_cache",
    "set_memory_fraction_fn": "vmalloc_set_memory_fraction",
    "set_record_stream_fn": "vmalloc_record_stream",
}


def configure(**options: Any) -> None:
    """Sets the global arenas' options (backend, capacity, chunk_size, small_max, history, eager_growth,
    growth_slack, mid_chunks, devices, block_size) before first use.

    Options not given keep their ``VMALLOC_CONF`` value. Raises ValueError for a bad option (checked now),
    RuntimeError once an arena exists.
    """
    known = {"backend", "capacity", "chunk_size", "small_max", "history", "eager_growth", "growth_slack", "mid_chunks",
             "devices", "block_size"}
    unknown = set(options) - known
    if unknown:
        raise TypeError(f"unknown vmalloc option(s) {sorted(unknown)}: use {', '.join(sorted(known))}")
    _C.configure(**options)


def _require_cuda_torch() -> Any:
    import torch

    if not hasattr(torch._C, "_cuda_changeCurrentAllocator"):
        raise RuntimeError(
            f"vmalloc.allocator() needs a CUDA build of PyTorch; this one ({torch.__version__}) has none. "
            "Without a GPU, use vmalloc.Arena(backend='host') or backend='sim'."
        )
    return torch


def _plain_allocator(malloc_symbol: str) -> Any:
    """torch's plain pluggable allocator over vmalloc's C entry points, with the hooks this torch offers."""
    import torch

    path = _C.library_path()
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, malloc_symbol, "vmalloc_free")
    lib = ctypes.CDLL(path)
    raw = alloc.allocator()
    for setter, symbol in _HOOKS.items():
        if hasattr(raw, setter):
            getattr(raw, setter)(ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value)
    return alloc


FALLBACK_ENV = "VMALLOC_ALLOW_FALLBACK"

# What the plain pluggable allocator breaks in global mode (Note [No silent fallback]).
FALLBACK_BREAKS = (
    "Tensor.record_stream() is a no-op (memory that a side stream or NCCL still uses can be handed out again "
    "while in use: a silent use-after-free), torch.cuda.memory_stats() and cudnn.benchmark=True raise, "
    "out-of-memory is a RuntimeError instead of torch.cuda.OutOfMemoryError, and torch.cuda.empty_cache() / "
    "set_per_process_memory_fraction() do not reach vmalloc"
)


def _adapter() -> Any:
    """The adapter module, loaded once and serving both modes, or None (``torch_adapter.reason()`` says why)."""
    global _ADAPTER, _ALLOCATOR, _POOL_ALLOCATOR
    if _ADAPTER is None:
        torch = _require_cuda_torch()
        adapter = torch_adapter.load()
        if adapter is not None:
            _ADAPTER = adapter
            # One object serves both modes: it knows whether torch calls it as the current allocator.
            _ALLOCATOR = _POOL_ALLOCATOR = torch.cuda.memory._CUDAAllocator(adapter.allocator())
    return _ADAPTER


def _fallback_allowed(fallback: Optional[bool]) -> bool:
    if fallback is not None:
        return bool(fallback)
    return os.environ.get(FALLBACK_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def allocator(fallback: Optional[bool] = None, **options: Any) -> Any:
    """vmalloc as a torch CUDA allocator, for ``torch.cuda.memory.change_current_allocator``.

    Install it before the first CUDA allocation. ``options`` are those of ``configure``. See
    Note [Two ways into torch] for what torch's memory API reports with it.

    Without the torch adapter it raises RuntimeError naming the reason and the fix, unless ``fallback=True``
    (or, with ``fallback`` left None, ``VMALLOC_ALLOW_FALLBACK=1``) accepts torch's plain pluggable allocator,
    where ``Tensor.record_stream()`` is a no-op: Note [No silent fallback].
    """
    global _ALLOCATOR
    if options:
        configure(**options)
    if _ALLOCATOR is None and _adapter() is None:
        reason = torch_adapter.reason()
        if not _fallback_allowed(fallback):
            raise RuntimeError(
                f"vmalloc.allocator(): vmalloc's torch adapter is not available: {reason}. Fix that, then "
                "`python -m vmalloc.torch_adapter` says whether it builds. Without the adapter torch's plain "
                f"pluggable allocator would serve, where {FALLBACK_BREAKS}. To run that way all the same, call "
                f"vmalloc.allocator(fallback=True) or set {FALLBACK_ENV}=1."
            )
        warnings.warn(
            f"vmalloc: running without vmalloc's torch adapter ({reason}), as asked (fallback): {FALLBACK_BREAKS}. "
            "Keep tensors on one stream (no record_stream, no NCCL), and read the arena with vmalloc.stats(), "
            "vmalloc.snapshot() and vmalloc.global_arena().",
            RuntimeWarning,
            stacklevel=2,
        )
        _ALLOCATOR = _plain_allocator("vmalloc_malloc")
    return _ALLOCATOR


def adapter_status() -> dict[str, Any]:
    """Whether the torch adapter serves vmalloc in this process (``adapter``), and if not why (``reason``)."""
    return {"adapter": _ADAPTER is not None, "reason": torch_adapter.reason()}


def installed() -> bool:
    """Whether vmalloc is torch's current CUDA allocator (global mode), even before its first allocation."""
    if _ALLOCATOR is None:
        return False
    if _ADAPTER is not None:
        return bool(_ADAPTER.is_current())
    import torch

    getter = getattr(torch._C, "_cuda_getAllocator", None)
    return getter is not None and getter() is _ALLOCATOR.allocator()


def global_arena(device: Optional[int] = None) -> Any:
    """The global arena of ``device`` (default: the current CUDA device), made now if needed."""
    if device is None:
        import torch

        device = torch.cuda.current_device()
    return _C.global_arena(device)


def mem_pool(**options: Any) -> Any:
    """A ``torch.cuda.MemPool`` whose memory comes from vmalloc; activate it with ``vmalloc.use_mem_pool``."""
    global _POOL_ALLOCATOR
    torch = _require_cuda_torch()
    if options:
        configure(**options)
    if not hasattr(torch.cuda, "MemPool"):
        raise RuntimeError(f"vmalloc.mem_pool() needs torch.cuda.MemPool (torch >= 2.5); this is {torch.__version__}")
    if _POOL_ALLOCATOR is None and _adapter() is None:  # no consent needed: Note [No silent fallback]
        warnings.warn(
            f"vmalloc.mem_pool(): vmalloc's torch adapter is not available ({torch_adapter.reason()}). torch's "
            "caching allocator keeps record_stream and its statistics in MemPool mode, but a CUDA graph captured "
            "inside vmalloc.use_mem_pool would take its memory from vmalloc's pool instead of its own private pool "
            "(replays could then overwrite live tensors): capture graphs outside the scope, or fix the cause above.",
            RuntimeWarning,
            stacklevel=2,
        )
        _POOL_ALLOCATOR = _plain_allocator("vmalloc_malloc_no_handler")
    if installed():
        raise RuntimeError(
            "vmalloc is already torch's global CUDA allocator: every allocation comes from it, so a vmalloc "
            "MemPool has nothing to add (and torch's pools need torch's own allocator as the current one)"
        )
    return torch.cuda.MemPool(_POOL_ALLOCATOR.allocator())


def _pool_bindings(torch: Any) -> tuple[Callable, Callable, Callable]:
    c = torch._C
    begin = getattr(c, "_cuda_beginAllocateToPool", None)  # filter: every stream, every thread
    end = getattr(c, "_cuda_endAllocateToPool", None) or getattr(c, "_cuda_endAllocateCurrentStreamToPool", None)
    release = getattr(c, "_cuda_releasePool", None)
    if begin is None or end is None or release is None:
        raise RuntimeError(
            f"vmalloc.use_mem_pool needs torch._C._cuda_beginAllocateToPool (torch >= 2.5); this is "
            f"{torch.__version__}: use torch.cuda.use_mem_pool(pool), which routes only the calling thread"
        )
    return begin, end, release


@contextlib.contextmanager
def use_mem_pool(pool: Any, device: Any = None) -> Iterator[Any]:
    """Routes every allocation on ``device`` (all threads, all streams: backward's too) to ``pool`` while
    active. See Note [MemPool mode routes every thread].

    Streams being captured into a CUDA graph keep their capture's private pool (with the torch adapter; see
    ``adapter_status()``), so graphs may be captured inside the scope. Limits that come from torch's caching
    allocator (Note [What a pool scope costs]): inside the scope a tensor freed after ``record_stream`` is
    held until the scope ends, an allocation the pool cannot serve raises ``torch.cuda.OutOfMemoryError``
    without releasing cached blocks first, and ``torch.cuda.empty_cache()`` releases nothing; global mode
    (``change_current_allocator(vmalloc.allocator())``) has none of these limits.
    """
    import torch

    begin, end, release = _pool_bindings(torch)
    index = torch.cuda.current_device() if device is None else torch.cuda._utils._get_device_index(device)
    if _ADAPTER is not None:  # declines capturing streams (Note [Pool scopes leave captures alone])
        begin = _ADAPTER.begin_allocate_to_pool
    elif torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "vmalloc.use_mem_pool was entered during a CUDA graph capture; without vmalloc's torch adapter "
            f"({torch_adapter.reason()}) the scope would route the capture's allocations to vmalloc's pool, "
            "which replay would corrupt. Enter the scope before capturing, or fix the adapter's build."
        )
    begin(index, pool.id)
    try:
        yield pool
    finally:
        end(index, pool.id)
        release(index, pool.id)


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
    memory and the allocation is tried once more. None removes the handler. Global mode only: MemPool
    allocations never call it (Note [MemPool mode routes every thread])."""
    _C.global_arena(device).set_oom_handler(fn)
