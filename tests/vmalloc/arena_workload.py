"""A random allocator workload that writes a pattern into every allocation and checks every live pattern,
on either backend (backends.py): the host writes and reads host memory; on the emulated driver stream work
writes and checks, and every hand-out is checked against pending work by the race detector. Used by the
fault sweeps and the backend-parametrized tests."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Optional

import vmalloc


@dataclass
class Tally:
    """What a run did: operations attempted and backend errors survived."""

    ops: int = 0
    errors: int = 0


class Workload:
    """Drives ``arena`` with seeded random malloc / free / record_stream / empty_cache / set_capacity.

    ``memory`` is a backends.HostMemory or FakeCudaMemory. ``on_error(exc)`` is called for every
    ``vmalloc.BackendError``, after which the workload checks the invariants and every live pattern and goes
    on; OOM is an allowed outcome. ``tick(rng)`` runs after every step.
    """

    def __init__(
        self,
        arena: Any,
        memory: Any,
        seed: int,
        max_large: int = 6,
        on_error: Optional[Callable[[BaseException], None]] = None,
        tick: Optional[Callable[[random.Random], None]] = None,
        check_every: int = 1,
    ) -> None:
        self.arena = arena
        self.memory = memory
        self.rng = random.Random(seed)
        self.chunk = arena.chunk_size
        self.small_max = arena.stats()["small_max"]
        self.max_large = max_large
        self.capacity = arena.capacity
        self.live: dict[int, tuple[int, int, int]] = {}  # addr -> (size, stream, tag)
        self.on_error = on_error
        self.tick = tick
        self.check_every = check_every
        self.tally = Tally()
        self.serial = 0

    def size(self) -> int:
        if self.rng.random() < 0.4:
            return self.rng.randint(1, max(1, self.small_max))
        return self.rng.randint(self.small_max + 1, self.max_large * self.chunk)

    def malloc(self) -> None:
        rng, streams = self.rng, self.memory.streams
        size, stream = self.size(), rng.choice(streams)
        try:
            addr = self.arena.malloc(size, stream)
        except vmalloc.OutOfMemoryError:
            return
        self.memory.handed_out(stream, addr, size)
        self.serial += 1
        tag = self.serial % 251 + 1
        self.memory.write(stream, addr, size, tag, rng)
        self.live[addr] = (size, stream, tag)
        if len(streams) > 1 and rng.random() < 0.2:
            other = rng.choice([s for s in streams if s != stream])
            self.memory.use_on(stream, other, addr, size, tag)
            self.arena.record_stream(addr, other)

    def free(self, addr: int) -> None:
        size, stream, tag = self.live[addr]
        self.memory.check(stream, addr, size, tag)
        self.arena.free(addr)
        del self.live[addr]

    def step(self) -> None:
        rng = self.rng
        r = rng.random()
        self.tally.ops += 1
        try:
            if r < 0.5 or not self.live:
                self.malloc()
            elif r < 0.9:
                self.free(rng.choice(sorted(self.live)))
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
        if self.tally.ops % self.check_every == 0:
            self.check()

    def check(self) -> None:
        self.arena.check_invariants()
        for addr, (size, stream, tag) in self.live.items():
            self.memory.check(stream, addr, size, tag)

    def run(self, steps: int) -> Tally:
        for _ in range(steps):
            self.step()
        return self.tally

    def drain(self) -> None:
        """Frees everything left and empties the cache."""
        for addr in sorted(self.live):
            self.free(addr)
        self.arena.empty_cache()
        self.arena.check_invariants()
