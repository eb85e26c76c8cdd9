"""Arena: one vmalloc allocator instance, on the cuda, host or sim backend."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

from . import _C


class Arena(_C.Arena):
    """A chunked virtual-address caching allocator.

    Args:
        backend: ``"cuda"`` (driver VMM on ``device``), ``"host"`` (real memory: memfd chunks mapped into a
            reserved address range; ``buffer()`` reads and writes it) or ``"sim"`` (bookkeeping only, for
            replaying traces larger than this machine).
        capacity: the most physical memory the arena may hold, as bytes or a string like ``"8GiB"``. None:
            cuda, device memory less max(1 GiB, 1/16); host, half the machine's memory; sim, 80 GiB.
        chunk_size: physical chunk size; a multiple of the backend's granularity (2 MiB on CUDA and sim,
            the page size on host).
        small_max: requests up to this size are carved from one-chunk slabs in 512 B steps.
        mid_chunks: requests above ``small_max`` up to this many chunks are carved from slabs of this many
            chunks in quarter-chunk steps (e.g. 4: up to 8 MiB, in 512 KiB steps), instead of being rounded
            up to whole chunks: less rounding waste for tensors of one to a few chunks, but the free parts of
            chunks that a slab's blocks still touch cannot serve large requests. 0 (default): whole chunks.
        device: CUDA device ordinal (cuda backend).
        history: how many trace entries ``snapshot()`` keeps (0: none).
        eager_growth: on a cache miss, create new chunks (while under capacity) before reclaiming cached
            ones. Default False: grow only within ``growth_slack``, then reuse cached chunks.
        growth_slack: on a cache miss under the capacity, new chunks are created rather than cached ones
            reclaimed while the chunks held stay within (1 + growth_slack) x the most chunks ever in use at
            once (default 0: reserved memory stays at the peak in use). Reclaiming costs unmap/map calls and a
            wait for the stream; a repeated training step settles with none through the step plan instead. The
            slack held is reported apart, in ``stats()["slack_bytes.all.current"]`` and
            ``["slack_bytes.all.peak"]`` (bytes beyond the most ever in use; reserved bytes include them).
        step_plan: learn a training step that repeats (the same allocations in the same order) and serve it
            from a planned layout in which allocations that never live at once share physical chunks, each
            at an address of its own: after the first planned iteration a step makes no driver call, with
            reserved memory at the peak in use (default True; stats()["num_plans"], ["num_plan_hits"],
            ["plan_chunks"]).
        devices: how many devices the host and sim backends present (``device`` must be below it); the
            cuda backend has the driver's devices.
        block_size: the largest physical block, one backend allocation of several chunks whose runs map with
            one call each (a multiple of ``chunk_size``; 0: 32 MiB; ``chunk_size``: one chunk per block).
            Memory goes back to the backend (``empty_cache``, a lower capacity) in whole blocks.

    ``malloc(nbytes, stream=0)`` returns an address and raises ``vmalloc.OutOfMemoryError`` when the
    request cannot be met within the capacity; ``free(addr)`` raises ``ValueError`` (changing nothing) for
    an address that is not live. A failing backend call raises ``vmalloc.BackendError`` naming the call and
    the system's reason, and leaves the arena usable. ``stats()`` uses ``torch.cuda.memory_stats()`` key
    names. ``buffer(addr, n)`` (host backend) is a memoryview that keeps the arena alive.
    """

    def set_oom_handler(self, fn: Optional[Callable[[int], bool]]) -> None:
        """Calls ``fn(nbytes)`` before a request fails; True means it freed memory and the request is tried
        once more. None removes the handler.

        The handler is kept on this object, where the garbage collector sees it, and the allocator calls it
        through a trampoline that holds this arena weakly: a handler that refers to its own arena (a cycle)
        is collected with the arena.
        """
        if fn is None:
            self.__dict__.pop("_oom_handler", None)
            super().set_oom_handler(None)
            return
        if not callable(fn):
            raise TypeError(f"the OOM handler must be callable as fn(nbytes) -> bool, not {type(fn).__name__}")
        self._oom_handler = fn
        super().set_oom_handler(_WeakHandler(self))

    def snapshot(self) -> dict[str, Any]:
        """The arena's state in PyTorch's memory-snapshot layout (see ``vmalloc.dump_snapshot``)."""
        from .snapshot import snapshot_dict

        return snapshot_dict(self)

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"vmalloc.Arena(backend={self.backend!r}, capacity={s['capacity']}, chunk_size={s['chunk_size']}, "
            f"allocated={s['allocated_bytes.all.current']}, reserved={s['reserved_bytes.all.current']})"
        )


class _WeakHandler:
    """Calls its arena's ``_oom_handler`` while the arena lives; False (nothing freed) after."""

    __slots__ = ("_arena",)

    def __init__(self, arena: Arena) -> None:
        self._arena = weakref.ref(arena)

    def __call__(self, nbytes: int) -> bool:
        arena = self._arena()
        handler = None if arena is None else arena.__dict__.get("_oom_handler")
        return bool(handler(nbytes)) if handler is not None else False
