"""An independent view of device memory through cuda-python (``cuda.bindings.driver``), for checking what
vmalloc and torch report: free/total memory (cuMemGetInfo) and what backs a pointer (VMM handle, range)."""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import torch


def driver() -> Any:
    from cuda.bindings import driver as d

    return d


def check(result: Any, what: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return rest[0] if len(rest) == 1 else rest


def make_context_current(device: int = 0) -> None:
    """Makes the device's primary context (torch's) current in this thread."""
    d = driver()
    check(d.cuInit(0), "cuInit")
    dev = check(d.cuDeviceGet(device), "cuDeviceGet")
    ctx = check(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def used_bytes() -> int:
    """Device memory in use by every process (total - free), from the driver."""
    free, total = check(driver().cuMemGetInfo(), "cuMemGetInfo")
    return int(total) - int(free)


def address_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the allocation or mapping containing ptr (cuMemGetAddressRange)."""
    base, size = check(driver().cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
    return int(base), int(size)


def vmm_backed(ptr: int) -> bool:
    """Whether ptr lies in memory mapped with cuMemMap (cuMemRetainAllocationHandle succeeds), as vmalloc's
    chunks are; memory from cudaMalloc (torch's native allocator) is not."""
    d = driver()
    err, handle = d.cuMemRetainAllocationHandle(ptr)
    if int(err) != 0:
        return False
    check(d.cuMemRelease(handle), "cuMemRelease")
    return True


def pinned_host(ptr: int) -> bool:
    """Whether a host address is page-locked and known to CUDA (cuPointerGetAttribute MEMORY_TYPE == HOST)."""
    d = driver()
    err, value = d.cuPointerGetAttribute(d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
    return int(err) == 0 and int(value) == int(d.CUmemorytype.CU_MEMORYTYPE_HOST)


class UsedMemoryPoller:
    """Polls cuMemGetInfo on a thread while active; ``peak`` is the most device memory seen in use."""

    def __init__(self, device: int = 0, interval_s: float = 0.0002) -> None:
        self.device, self.interval = device, interval_s
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def sample(self) -> None:
        self.peak = max(self.peak, used_bytes())
        self.samples += 1

    def _run(self) -> None:
        make_context_current(self.device)
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.interval)

    def __enter__(self) -> UsedMemoryPoller:
        torch.cuda.synchronize()
        self.sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.synchronize()
        self._stop.set()
        self._thread.join()
        self.sample()
