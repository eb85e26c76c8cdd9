"""Random alloc / free / empty_cache sequences on real host memory, checking every DESIGN.md invariant
after each step: live allocations never overlap; every live allocation keeps its own written pattern
(across reclaims); reserved <= capacity; a request succeeds whenever enough chunks are free; every
statistic equals a recount."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import vmalloc

KiB = 1024
CHUNK = 64 * KiB
CAPACITY = 32 * CHUNK
SMALL_MAX = 16 * KiB

sizes = st.one_of(st.integers(1, SMALL_MAX), st.integers(SMALL_MAX + 1, 10 * CHUNK))


class ArenaMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.arena = vmalloc.Arena("host", capacity=CAPACITY, chunk_size=CHUNK, small_max=SMALL_MAX, history=64)
        self.live: dict[int, tuple[int, int, bytes]] = {}  # addr -> (size, stream, pattern)
        self.serial = 0

    def used_chunks(self) -> int:
        """Chunks that hold live data: large allocations' ranges and slabs with a block in use."""
        used = 0
        for seg in self.arena.snapshot()["segments"]:
            if any(b["state"] == "active_allocated" for b in seg["blocks"]):
                used += seg["total_size"] // CHUNK
        return used

    @rule(size=sizes, stream=st.integers(0, 2))
    def alloc(self, size, stream):
        free_chunks = CAPACITY // CHUNK - self.used_chunks()
        need = 1 if size <= SMALL_MAX else -(-size // CHUNK)
        try:
            addr = self.arena.malloc(size, stream)
        except vmalloc.OutOfMemoryError:
            assert need > free_chunks, f"OOM for {need} chunks while {free_chunks} were free"
            return
        self.serial += 1
        pattern = self.serial.to_bytes(4, "little") * (size // 4) + b"\xee" * (size % 4)
        self.arena.buffer(addr, size)[:] = pattern
        self.live[addr] = (size, stream, pattern)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        addr = data.draw(st.sampled_from(sorted(self.live)))
        self.arena.free(addr)
        del self.live[addr]

    @rule()
    def empty_cache(self):
        self.arena.empty_cache()
        s = self.arena.stats()
        assert s["num_cached_chunks"] == s["num_pool_chunks"] == s["num_empty_slabs"] == 0

    @invariant()
    def consistent(self):
        self.arena.check_invariants()
        s = self.arena.stats()
        assert s["reserved_bytes.all.current"] <= CAPACITY
        assert s["reserved_bytes.all.peak"] <= CAPACITY
        # Live allocations never overlap.
        spans = sorted((a, a + size) for a, (size, _, _) in self.live.items())
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
        # Each keeps its pattern.
        for addr, (size, _, pattern) in self.live.items():
            assert bytes(self.arena.buffer(addr, size)) == pattern
        # Stats equal a recount: from our own books and from the snapshot.
        assert s["requested_bytes.all.current"] == sum(size for size, _, _ in self.live.values())
        assert s["allocation.all.current"] == len(self.live)
        snap = self.arena.snapshot()
        blocks = [b for seg in snap["segments"] for b in seg["blocks"]]
        allocated = [b for b in blocks if b["state"] == "active_allocated"]
        assert {b["address"] for b in allocated} == set(self.live)
        assert s["allocated_bytes.all.current"] == sum(b["size"] for b in allocated)
        assert s["mapped_bytes.all.current"] == sum(seg["total_size"] for seg in snap["segments"])
        assert s["reserved_bytes.all.current"] == s["mapped_bytes.all.current"] + s["num_pool_chunks"] * CHUNK
        assert s["num_alloc"] - s["num_free"] == len(self.live)


ArenaMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)
TestArenaProperties = ArenaMachine.TestCase
