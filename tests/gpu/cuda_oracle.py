"""An independent view of device memory through cuda-python (``cuda.bindings.driver``), for checking what
vmalloc and torch report: free/total memory (cuMemGetInfo) and what backs a pointer (VMM handle, range)."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

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


def stack_size() -> int:
    """The per-thread stack size of the current context (cuCtxGetLimit(CU_LIMIT_STACK_SIZE)): the driver raises
    it when a kernel needs more local memory, and holds that much for every thread the device can run."""
    d = driver()
    return int(check(d.cuCtxGetLimit(d.CUlimit.CU_LIMIT_STACK_SIZE), "cuCtxGetLimit"))


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


# Note [What the oracle counts]
# cuMemGetInfo counts every byte the driver holds on the device for anyone: the allocator's chunks, and also
# what no allocator sees (the context, loaded kernel modules, local memory for every thread the device can run,
# which the driver grows when a kernel needs a larger stack, library handles). So the poller also reads the
# allocator's reserved bytes at each sample (``held``): ``outside_peak`` is the most the driver held beyond
# them. An oracle above the budget with the allocator's own peak within it is memory outside the allocator,
# and its growth over the run says how much. The poller also keeps its first sample (``start_used``,
# ``start_held``): measured from there, a one-time growth before it (the driver's, on the swap runtime's first
# iteration) is left out, and what grows while it runs is not (Note [The oracle from the last iteration's start]
# in tests/gpu/swap_worker.py).
class UsedMemoryPoller:
    """Polls cuMemGetInfo on a thread while active; ``peak`` is the most device memory seen in use, and, given
    ``held`` (the allocator's reserved bytes, read at each sample), ``outside_peak`` the most beyond it."""

    def __init__(self, device: int = 0, interval_s: float = 0.0002, held: Optional[Callable[[], int]] = None) -> None:
        self.device, self.interval = device, interval_s
        self.held = held
        self.peak = 0
        self.outside_peak = 0
        self.samples = 0
        self.start_used: Optional[int] = None  # the first sample: device memory in use, the allocator's part
        self.start_held: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def sample(self) -> None:
        before = self.held() if self.held is not None else 0
        used = used_bytes()
        held = max(before, self.held()) if self.held is not None else 0  # it may grow between the reads
        self.peak = max(self.peak, used)
        self.outside_peak = max(self.outside_peak, used - held)
        self.samples += 1
        if self.start_used is None:
            self.start_used, self.start_held = used, held

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
