"""The host pool: where swapped-out variables live.

Host memory is taken in large blocks and sub-allocated best fit with coalescing, so the steady state pins
nothing per tensor. Blocks are reused across iterations, never exceed ``limit``, and are all returned by
``close()``.

Note [Exact-size pinned blocks]
torch's pinned-memory allocator (``pin_memory=True``) rounds every request up to a power of two (users
measure 1.8-1.9x the host RAM they asked for) and keeps freed blocks cached for the life of the process. The
pool instead owns its blocks as plain numpy allocations of exactly the block size and, on CUDA runs,
page-locks each one (``cudaHostRegister`` through the CUDA runtime torch itself links, ``torch.cuda.cudart()``,
portable to every context: no package beyond torch), so the pinned bytes are the blocks' bytes and ``close()``
unpins every one (``cudaHostUnregister``). Tensors are numpy views, so a view that outlives ``close()``
keeps valid (then unpinned) memory, never a dangling pointer. Without CUDA the same path runs with no
registration.

Note [Pageable fallback]
Pinning can fail where swapping still works: a sandbox that refuses page-locking (``cudaHostRegister``
returns cudaErrorNotPermitted / NotSupported), or a locked-memory limit reached mid-run. The pool then
warns once (``PinningUnavailable``, naming the cause) and keeps going with pageable blocks: copies between
the device and pageable memory are staged by the driver, synchronous for the host and slower, so swapping
overlaps less with compute, but results are unchanged. Blocks pinned before the
failure stay pinned and are unpinned at ``close()``.

Note [Host pool on CPU runs]
Blocks are wrapped as tensors with the dispatch modes switched off, so a meter counting the compute device's
live tensors (swap.runtime.machine.meter) does not mistake host copies for device memory.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes

ALIGN = 512
PAGE = 4096


class HostPoolExhausted(MemoryError):
    """The host pool would exceed its limit."""


class PinningUnavailable(UserWarning):
    """The host pool could not page-lock its memory and uses pageable memory instead (Note [Pageable fallback])."""


class Pinner(Protocol):
    """Page-locks host ranges for asynchronous copies (``TorchHostRegistrar``; tests pass a fake)."""

    def pin(self, addr: int, nbytes: int) -> None: ...

    def unpin(self, addr: int) -> None: ...


class TorchHostRegistrar:
    """Pins host memory with the CUDA runtime torch links (``torch.cuda.cudart()``), for every context
    (``cudaHostRegisterPortable``), as torch's own pinning helpers do."""

    PORTABLE = 1  # cudaHostRegisterPortable

    def __init__(self) -> None:
        torch.cuda.init()  # raises, saying why, where CUDA is unavailable
        self.cudart = torch.cuda.cudart()

    # Note [A failed call leaves no error behind]
    # The CUDA runtime records a failed call's error as the calling thread's *last error* until something reads
    # it, and torch's launch check after every kernel (``C10_CUDA_KERNEL_LAUNCH_CHECK``: ``cudaGetLastError``)
    # reads it: a refused ``cudaHostRegister`` (a sandbox that forbids page-locking, a locked-memory limit) made
    # the next kernel launched on that thread raise "CUDA error: ..." for a call it never made, so Note
    # [Pageable fallback] crashed the run it was written to keep alive (the staging pool pins lazily, on
    # autograd's thread, inside backward). A failed call here reads the error back at once, which clears it.
    # torch's binding of the runtime has no ``cudaGetLastError``; it is looked up in the runtime library the
    # process loaded (the one whose per-thread error the call set).
    def _check(self, err: Any, what: str) -> None:
        if int(err) != 0:
            clear_last_error(self.cudart)
            raise RuntimeError(f"swap host pool: {what} failed: {self.cudart.cudaGetErrorString(err)} ({int(err)})")

    def pin(self, addr: int, nbytes: int) -> None:
        self._check(self.cudart.cudaHostRegister(addr, nbytes, self.PORTABLE), f"cudaHostRegister({nbytes} bytes)")

    def unpin(self, addr: int) -> None:
        self._check(self.cudart.cudaHostUnregister(addr), "cudaHostUnregister")


def clear_last_error(cudart: Any) -> None:
    """Reads (and so clears) this thread's last CUDA runtime error (Note [A failed call leaves no error
    behind]): through ``cudart`` if it has ``cudaGetLastError``, else through the runtime library loaded."""
    get = getattr(cudart, "cudaGetLastError", None) or _loaded_get_last_error()
    if get is not None:
        get()


@functools.cache
def _loaded_get_last_error() -> Optional[Callable[[], int]]:
    """``cudaGetLastError`` of the CUDA runtime library this process loaded (None: none found)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart" in line.rsplit("/", 1)[-1]})
    except OSError:
        paths = []
    for path in paths:
        try:
            return ctypes.CDLL(path).cudaGetLastError
        except (OSError, AttributeError):
            continue
    return None


@dataclass
class HostBlock:
    """A sub-allocation: ``view`` is a uint8 tensor of ``nbytes`` inside block ``block``."""

    block: int
    offset: int
    size: int  # aligned size taken from the block
    nbytes: int
    view: torch.Tensor
    fence: Any = None  # the last copy that read or wrote it, for its user to order the next one after


class HostPool:
    """Host memory for swapped variables. ``pinned``: page-lock the blocks (CUDA runs), with ``pinner`` or,
    by default, the CUDA runtime torch links (see Note [Exact-size pinned blocks]). ``device`` is accepted for
    callers that name one: registration is portable to every device."""

    def __init__(self, pinned: bool, limit: Optional[int] = None, block_size: int = 256 << 20,
                 pinner: Optional[Pinner] = None, device: Optional[torch.device] = None) -> None:  # fmt: skip
        self.pinned = pinned
        self.limit = limit
        self.block_size = block_size
        self._pinner: Optional[Pinner] = pinner
        self._device = device
        self._blocks: list[np.ndarray] = []
        self._free: list[list[tuple[int, int]]] = []  # per block: sorted (offset, size) free intervals
        self._lock = threading.RLock()  # re-entrant: a GC finalizer freeing a block may run while it is held
        self.used = 0
        self.peak_used = 0
        self.pinned_bytes = 0  # bytes page-locked now: the blocks' sizes exactly, 0 after close()
        self._pinned_blocks: dict[int, int] = {}  # address -> bytes of each block page-locked now
        self.closed = False

    @property
    def reserved(self) -> int:
        return sum(b.size for b in self._blocks)

    def _pin(self, block: np.ndarray) -> None:
        try:
            if self._pinner is None:
                self._pinner = TorchHostRegistrar()
            self._pinner.pin(block.ctypes.data, block.size)
        except Exception as e:  # noqa: BLE001 - any cause: pinning is an optimisation (Note [Pageable fallback])
            self.pinned = False  # no further attempts, so one warning
            warnings.warn(
                f"swap host pool: cannot page-lock host memory ({type(e).__name__}: {e}); using pageable host "
                "memory instead. Copies to and from pageable memory are synchronous for the host and slower, so "
                "swapping overlaps less with compute (results are unchanged).",
                PinningUnavailable,
                stacklevel=4,
            )
            return
        self._pinned_blocks[block.ctypes.data] = block.size
        self.pinned_bytes += block.size

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
        # Page-aligned, exactly `size` bytes: registration then pins the block's pages and nothing else.
        raw = np.empty(size + PAGE, dtype=np.uint8)  # sliced in numpy: no dispatched op touches it
        start = -raw.ctypes.data % PAGE
        block = raw[start : start + size]
        if self.pinned:
            self._pin(block)
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
            with _disable_current_modes():  # from_numpy dispatches lift_fresh: keep it out of meters
                view = torch.from_numpy(self._blocks[b][off : off + nbytes])
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
        """Unpins and returns every block. Call it once no copy uses the pool (the manager drains first);
        views still held elsewhere keep their (now unpinned) memory alive."""
        with self._lock:
            self.closed = True
            for addr, nbytes in list(self._pinned_blocks.items()):
                self._pinner.unpin(addr)
                del self._pinned_blocks[addr]
                self.pinned_bytes -= nbytes
            self._blocks.clear()
            self._free.clear()
            self.used = 0
