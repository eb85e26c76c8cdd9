"""The two backends the allocator's tests run on: the host backend (real memory, written and checked by the
host) and the cuda backend on the emulated driver (tests/fakecuda: device memory backed by host memory,
written and checked by asynchronous stream work, every hand-out checked by the race detector).

Note [cuda tests in a child process]
The cuda backend loads its driver once per process, and a library with the soname libcuda.so.1 that is
already loaded is what every later dlopen("libcuda.so.1") gets, torch's included. So the emulated driver is
never loaded into the main test process (on a GPU machine tests/gpu must get the real one): a test
parametrized with backend "cuda" (or marked cuda_fake) runs in a child pytest with VMALLOC_LIBCUDA set
(conftest.py), and its fixtures load the emulator only there.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np

import vmalloc

KiB, MiB = 1024, 1024 * 1024


def in_fake_driver_process() -> bool:
    """Whether this process's cuda backend runs on the emulated driver (a child, see the Note)."""
    return bool(os.environ.get("VMALLOC_LIBCUDA"))


class HostMemory:
    """The host backend: allocations written and checked through their addresses, synchronously."""

    name = "host"
    holds_bytes = True  # write() and check() touch the allocation's bytes

    def __init__(self) -> None:
        self.streams: tuple[int, ...] = (0, 1, 2)  # stream handles are opaque to the host backend

    def arena(self, **kw: Any) -> Any:
        # mid_chunks=2: the property tests and workloads cover mid-size slabs (Note [Mid-size blocks]) too
        kw = {"capacity": 32 * 64 * KiB, "chunk_size": 64 * KiB, "small_max": 16 * KiB, "mid_chunks": 2, **kw}
        return vmalloc.Arena("host", **kw)

    def thread_init(self) -> None:
        pass

    def handed_out(self, stream: int, addr: int, size: int) -> None:
        pass

    def write(self, stream: int, addr: int, size: int, tag: int, rng: Optional[random.Random] = None) -> None:
        ctypes.memset(addr, tag, size)

    def check(self, stream: int, addr: int, size: int, tag: int) -> None:
        data = np.frombuffer((ctypes.c_ubyte * size).from_address(addr), np.uint8)  # a view: no copy
        assert (data == tag).all(), f"allocation at {addr:#x} lost its data"

    def use_on(self, src: int, dst: int, addr: int, size: int, tag: int) -> None:
        """The allocation is also used on `dst` (the caller then tells the arena with record_stream)."""

    def finish(self) -> None:
        pass


class SimMemory(HostMemory):
    """The sim backend: addresses and bookkeeping, no bytes (it replays paper-scale traces on a small
    machine), so there is nothing to write or check; the allocator's invariants are what is checked."""

    name = "sim"
    holds_bytes = False

    def arena(self, **kw: Any) -> Any:
        kw = {"capacity": 64 * 2 * MiB, "chunk_size": 2 * MiB, "small_max": 256 * KiB, **kw}
        return vmalloc.Arena("sim", **kw)

    def write(self, stream: int, addr: int, size: int, tag: int, rng: Optional[random.Random] = None) -> None:
        pass

    def check(self, stream: int, addr: int, size: int, tag: int) -> None:
        pass


class FakeCudaMemory:
    """The cuda backend on the emulated driver: stream work writes and checks the data (mismatches and
    unordered reuse become race-detector violations, asserted empty by finish())."""

    name = "cuda"
    holds_bytes = True

    def __init__(self, delay_us: int = 300, order_with_events: bool = True) -> None:
        import fakecuda  # only in a child process (Note [cuda tests in a child process])

        self.fc = fakecuda.driver()
        self.fc.set_faults("")
        self.fc.drain()
        self.fc.reset()
        self.own = [self.fc.stream(), self.fc.stream(nonblocking=True)]
        self.streams = (0, *self.own)
        self.delay_us = delay_us
        # False: use_on orders the other stream by waiting on the host instead (fault sweeps count the
        # driver's event calls and must not fail the test's own).
        self.order_with_events = order_with_events

    def arena(self, **kw: Any) -> Any:
        # The emulator's granularity is 2 MiB, as on current GPUs.
        kw = {"capacity": 32 * 2 * MiB, "chunk_size": 2 * MiB, "small_max": 256 * KiB, "mid_chunks": 2, **kw}
        return vmalloc.Arena("cuda", **kw)

    def thread_init(self) -> None:
        """A thread that submits work needs a current context (the legacy stream does), as on CUDA."""
        self.fc.make_current(0)

    def handed_out(self, stream: int, addr: int, size: int) -> None:
        self.fc.check_reuse(stream, addr, size)

    def write(self, stream: int, addr: int, size: int, tag: int, rng: Optional[random.Random] = None) -> None:
        delay = rng.choice([0, 0, self.delay_us]) if rng else 0
        self.fc.fill(stream, addr, size, tag, delay)

    def check(self, stream: int, addr: int, size: int, tag: int) -> None:
        self.fc.expect(stream, addr, size, tag)

    def use_on(self, src: int, dst: int, addr: int, size: int, tag: int) -> None:
        if self.order_with_events:
            e = self.fc.event()
            self.fc.record(e, src)
            self.fc.wait_event(dst, e)
            self.fc.destroy_event(e)
        else:
            self.fc.synchronize(src)
        self.fc.expect(dst, addr, size, tag, self.delay_us)

    def finish(self) -> None:
        self.fc.set_faults("")
        self.fc.drain()
        found = self.fc.violations()
        misuses = self.fc.misuses()
        for s in self.own:
            self.fc.destroy_stream(s)
        self.own = []
        self.fc.reset()
        assert not found, f"race detector: {len(found)} violation(s):\n\n" + "\n\n".join(found[:5])
        assert not misuses, f"driver rules broken: {misuses[:5]}"


def memory_for(backend: str) -> Any:
    return HostMemory() if backend == "host" else FakeCudaMemory()


CHUNK_SIZES = {"host": 64 * 1024, "cuda": 2 * 1024 * 1024}  # the emulator's granularity is 2 MiB


@contextlib.contextmanager
def driver(backend: str) -> Iterator[int]:
    """The stream to use; on the emulated driver, checked for races at the end (in the child process)."""
    if backend == "host":
        yield 0
        return
    assert in_fake_driver_process()
    mem = FakeCudaMemory()
    yield mem.own[0]
    mem.finish()
