"""The host pool: where swapped-out variables live.

Host memory is taken in large blocks (pinned on CUDA runs, so copies are asynchronous; plain memory on CPU
runs) and sub-allocated best fit with coalescing, so the steady state pins nothing per tensor. Blocks are
reused across iterations, never exceed ``limit``, and are all returned by ``close()``.

Note [Host pool on CPU runs]
CPU blocks are numpy allocations, wrapped as tensors with the dispatch modes switched off, so a meter
counting the compute device's live tensors (swap.meter) does not mistake host copies for device memory.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes

ALIGN = 512


class HostPoolExhausted(MemoryError):
    """The host pool would exceed its limit."""


@dataclass
class HostBlock:
    """A sub-allocation: ``view`` is a uint8 tensor of ``nbytes`` inside block ``block``."""

    block: int
    offset: int
    size: int  # aligned size taken from the block
    nbytes: int
    view: torch.Tensor


class HostPool:
    def __init__(self, pinned: bool, limit: Optional[int] = None, block_size: int = 256 << 20) -> None:
        self.pinned = pinned
        self.limit = limit
        self.block_size = block_size
        self._blocks: list[Any] = []  # pinned tensors (CUDA runs) or numpy arrays (CPU runs)
        self._free: list[list[tuple[int, int]]] = []  # per block: sorted (offset, size) free intervals
        self._lock = threading.Lock()
        self.used = 0
        self.peak_used = 0
        self.closed = False

    @property
    def reserved(self) -> int:
        return sum(b.size if isinstance(b, np.ndarray) else b.numel() for b in self._blocks)

    def _new_block(self, request: int) -> int:
        need = -(-request // ALIGN) * ALIGN
        size = max(self.block_size, need)
        if self.limit is not None and self.reserved + size > self.limit:
            size = max(need, (self.limit - self.reserved) // ALIGN * ALIGN)  # a smaller last block
            if self.reserved + size > self.limit:
                raise HostPoolExhausted(
                    f"swap host pool: {self.reserved + size} bytes would exceed host_pool_limit={self.limit} "
                    f"({self.used} in use); raise host_pool_limit or lower the batch size"
                )
        if self.pinned:
            block: Any = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        else:
            block = np.empty(size, dtype=np.uint8)  # sliced in numpy: no dispatched op touches it
        self._blocks.append(block)
        self._free.append([(0, size)])
        return len(self._blocks) - 1

    def alloc(self, nbytes: int) -> HostBlock:
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            if self.closed:
                raise RuntimeError("swap host pool is closed (the SwapManager has exited)")
            best = None  # (size, block, index)
            for b, free in enumerate(self._free):
                for k, (_off, sz) in enumerate(free):
                    if sz >= size and (best is None or sz < best[0]):
                        best = (sz, b, k)
            if best is None:
                b = self._new_block(size)
                best = (self._free[b][0][1], b, 0)
            sz, b, k = best
            off = self._free[b][k][0]
            if sz == size:
                del self._free[b][k]
            else:
                self._free[b][k] = (off + size, sz - size)
            self.used += size
            self.peak_used = max(self.peak_used, self.used)
            block = self._blocks[b]
            if self.pinned:
                view = block[off : off + nbytes]
            else:
                with _disable_current_modes():  # from_numpy dispatches lift_fresh: keep it out of meters
                    view = torch.from_numpy(block[off : off + nbytes])
            return HostBlock(b, off, size, nbytes, view)

    def free(self, hb: HostBlock) -> None:
        with self._lock:
            if self.closed:
                return
            self.used -= hb.size
            free = self._free[hb.block]
            i = bisect.bisect_left(free, (hb.offset, 0))
            off, size = hb.offset, hb.size
            if i < len(free) and off + size == free[i][0]:
                size += free[i][1]
                del free[i]
            if i > 0 and free[i - 1][0] + free[i - 1][1] == off:
                off, size = free[i - 1][0], free[i - 1][1] + size
                del free[i - 1]
                i -= 1
            free.insert(i, (off, size))

    def close(self) -> None:
        """Returns every block (views still held elsewhere keep only their own block alive)."""
        with self._lock:
            self.closed = True
            self._blocks.clear()
            self._free.clear()
            self.used = 0
