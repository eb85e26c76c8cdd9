"""A random allocator workload that writes a pattern into every allocation and checks every live pattern,
on either backend (backends.py): the host writes and reads host memory; on the emulated driver stream work
writes and checks, and every hand-out is checked against pending work by the race detector. Used by the
fault sweeps and the backend-parametrized tests."""

from __future__ import annotations

import bisect
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

    ``memory`` is a backends.HostMemory, SimMemory or FakeCudaMemory. ``on_error(exc)`` is called for every
    ``vmalloc.BackendError``, after which the workload checks the invariants and every live pattern and goes
    on; OOM is an allowed outcome. ``tick(rng)`` runs after every step. Every ``check_every`` steps the
    arena's invariants are checked, and every live pattern too (every ``verify_every`` steps, if given).

    Checked against the workload's own books, whatever the arena says: a new allocation overlaps no live
    one. ``strict`` (no injected faults) adds: an OOM only when the request needs more chunks than the
    capacity leaves beside the chunks holding live data, and the arena's counts of live allocations and
    requested bytes equal the books.
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
        verify_every: Optional[int] = None,
        strict: bool = False,
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
        self.verify_every = verify_every or check_every
        self.strict = strict
        self.tally = Tally()
        self.serial = 0
        self.starts: list[int] = []  # the live addresses, sorted
        self.requested = 0  # bytes of the live allocations

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
            if self.strict:
                self.check_oom(size)
            return
        self.check_disjoint(addr, size)
        bisect.insort(self.starts, addr)
        self.requested += size
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
        del self.starts[bisect.bisect_left(self.starts, addr)]
        self.requested -= size

    def check_disjoint(self, addr: int, size: int) -> None:
        """A new allocation [addr, addr + size) overlaps no live one."""
        i = bisect.bisect_left(self.starts, addr)
        if i > 0:
            before = self.starts[i - 1]
            assert before + self.live[before][0] <= addr, f"{addr:#x} overlaps the live allocation at {before:#x}"
        if i < len(self.starts):
            assert addr + size <= self.starts[i], f"{addr:#x} (+{size}) overlaps the live one at {self.starts[i]:#x}"

    def check_oom(self, size: int) -> None:
        """An OOM is justified: the request needs more chunks than the capacity leaves beside the chunks that
        hold live data (frees pending on other streams are waited for before a request fails)."""
        need = 1 if size <= self.small_max else -(-size // self.chunk)
        used = sum(seg_size // self.chunk for _addr, seg_size, _stream, _small, blocks in self.arena._segments()
                   if any(state == "active_allocated" for *_, state in blocks))  # fmt: skip
        free = self.arena.capacity // self.chunk - used
        assert need > free, f"OOM for {size} bytes ({need} chunks) while {free} of the capacity's chunks were free"

    def step(self) -> None:
        rng = self.rng
        r = rng.random()
        self.tally.ops += 1
        try:
            if r < 0.5 or not self.live:
                self.malloc()
            elif r < 0.9:
                self.free(rng.choice(self.starts))
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
            self.check(patterns=self.tally.ops % self.verify_every == 0)

    def check(self, patterns: bool = True) -> None:
        self.arena.check_invariants()
        # stats() builds a dict of every statistic (~8 us, half an operation's cost on the sim backend), and
        # check_invariants has just recounted each from the arena's structures: the books every 16 steps.
        if self.strict and self.tally.ops % 16 == 0:
            s = self.arena.stats()
            assert s["allocation.all.current"] == len(self.live), "the arena's live count is not the books'"
            assert s["requested_bytes.all.current"] == self.requested, "the arena's requested bytes are not the books'"
        if patterns and self.memory.holds_bytes:
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
