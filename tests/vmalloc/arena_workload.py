"""A random allocator workload that writes a pattern into every allocation and checks every live pattern
after each step, through ctypes at the allocation's address (host memory on the host backend, the emulated
driver's host-backed device memory on the cuda backend). Used by the fault sweeps and the backend-
parametrized tests."""

from __future__ import annotations

import ctypes
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import vmalloc

KiB = 1024


@dataclass
class Tally:
    """What a run did: operations attempted, backend errors survived, and the calls they named."""

    ops: int = 0
    errors: int = 0
    calls_named: set[str] = field(default_factory=set)


def write(addr: int, size: int, tag: int) -> None:
    ctypes.memset(addr, tag, size)


def intact(addr: int, size: int, tag: int) -> bool:
    return ctypes.string_at(addr, size) == bytes([tag]) * size


class Workload:
    """Drives ``arena`` with seeded random malloc / free / record_stream / empty_cache / set_capacity.

    ``on_error(exc)`` is called for every ``vmalloc.BackendError`` (after which the workload checks the
    invariants and every live pattern, and goes on); OOM is an allowed outcome. ``streams`` are the stream
    handles to use (0 and fake values on the host backend; real emulator streams on cuda).
    """

    def __init__(
        self,
        arena: Any,
        seed: int,
        streams: tuple[int, ...] = (0, 1, 2),
        max_large: int = 6,
        on_error: Optional[Callable[[BaseException], None]] = None,
        tick: Optional[Callable[[random.Random], None]] = None,
    ) -> None:
        self.arena = arena
        self.rng = random.Random(seed)
        self.streams = streams
        self.chunk = arena.chunk_size
        self.small_max = arena.stats()["small_max"]
        self.max_large = max_large
        self.capacity = arena.capacity
        self.live: dict[int, tuple[int, int]] = {}  # addr -> (size, tag)
        self.on_error = on_error
        self.tick = tick
        self.tally = Tally()
        self.serial = 0

    def size(self) -> int:
        if self.rng.random() < 0.4:
            return self.rng.randint(1, max(1, self.small_max))
        return self.rng.randint(self.small_max + 1, self.max_large * self.chunk)

    def step(self) -> None:
        rng = self.rng
        r = rng.random()
        self.tally.ops += 1
        try:
            if r < 0.5 or not self.live:
                size = self.size()
                stream = rng.choice(self.streams)
                try:
                    addr = self.arena.malloc(size, stream)
                except vmalloc.OutOfMemoryError:
                    return
                self.serial += 1
                tag = self.serial % 251 + 1
                write(addr, size, tag)
                self.live[addr] = (size, tag)
                if len(self.streams) > 1 and rng.random() < 0.2:
                    self.arena.record_stream(addr, rng.choice([s for s in self.streams if s != stream]))
            elif r < 0.9:
                addr = rng.choice(sorted(self.live))
                self.arena.free(addr)
                del self.live[addr]
            elif r < 0.95:
                self.arena.empty_cache()
            else:
                self.arena.set_capacity(rng.randint(self.capacity // 2, self.capacity) // self.chunk * self.chunk)
        except vmalloc.BackendError as e:
            self.tally.errors += 1
            if self.on_error is not None:
                self.on_error(e)
        if self.tick is not None:
            self.tick(rng)
        self.check()

    def check(self) -> None:
        self.arena.check_invariants()
        for addr, (size, tag) in self.live.items():
            assert intact(addr, size, tag), f"allocation at {addr:#x} ({size} bytes) lost its data"

    def run(self, steps: int) -> Tally:
        for _ in range(steps):
            self.step()
        return self.tally

    def drain(self) -> None:
        """Frees everything left (retrying frees a backend fault refused) and empties the cache."""
        for addr in sorted(self.live):
            self.arena.free(addr)
        self.live.clear()
        self.arena.empty_cache()
        self.arena.check_invariants()
