"""Arena: one vmalloc allocator instance, on the cuda, host or sim backend."""

from __future__ import annotations

from typing import Any

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
        device: CUDA device ordinal (cuda backend).
        history: how many trace entries ``snapshot()`` keeps (0: none).
        eager_growth: on a cache miss, create new chunks (while under capacity) before reclaiming cached
            ones. Default False: reuse cached chunks first, so reserved memory stays at the peak of
            allocated memory, at the price of more unmap/map calls.

    ``malloc(nbytes, stream=0)`` returns an address and raises ``vmalloc.OutOfMemoryError`` when the
    request cannot be met within the capacity; ``free(addr)`` raises ``ValueError`` (changing nothing) for
    an address that is not live. ``stats()`` uses ``torch.cuda.memory_stats()`` key names.
    """

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
