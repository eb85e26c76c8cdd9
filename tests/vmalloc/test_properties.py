"""Random alloc / free / record_stream / empty_cache sequences, on the host backend (real memory) and on the
cuda backend against the emulated driver (stream work writes and checks the data; the race detector checks
every hand-out and unmap), checking every DESIGN.md invariant after each step: live allocations never
overlap; every live allocation keeps its own written pattern (across reclaims); reserved <= capacity; a
request succeeds whenever enough chunks are free; every statistic equals a recount."""

import pytest
from backends import FakeCudaMemory, HostMemory
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from run_summary import SUMMARY

import vmalloc

CHUNKS = 32


class ArenaMachine(RuleBasedStateMachine):
    memory_type = HostMemory

    def __init__(self):
        super().__init__()
        self.memory = self.memory_type()
        self.arena = self.memory.arena(capacity=CHUNKS * self.chunk_size(), history=64)
        self.chunk = self.arena.chunk_size
        self.small_max = self.arena.stats()["small_max"]
        self.live: dict[int, tuple[int, int, int]] = {}  # addr -> (size, stream, tag)
        self.serial = 0
        self.ops = 0

    def chunk_size(self) -> int:
        return 64 * 1024 if self.memory_type is HostMemory else 2 * 1024 * 1024

    def used_chunks(self) -> int:
        """Chunks that hold live data: the chunks a block in use overlaps (a large allocation's range; one
        chunk of a small slab; the chunks of a mid slab that its blocks in use touch, the rest being cut out
        when memory runs short: Note [Mid-size blocks]). Frees pending other streams are waited for before a
        request fails, so they count as free."""
        used = set()
        for seg, _size, _stream, _small, blocks in self.arena._segments():
            for addr, size, _requested, state in blocks:
                if state == "active_allocated":
                    first, last = (addr - seg) // self.chunk, (addr + size - 1 - seg) // self.chunk
                    used.update(seg + c * self.chunk for c in range(first, last + 1))
        return len(used)

    @rule(data=st.data(), large=st.booleans(), stream_index=st.integers(0, 2), share=st.integers(0, 4))
    def alloc(self, data, large, stream_index, share):
        size = (data.draw(st.integers(self.small_max + 1, 10 * self.chunk)) if large
                else data.draw(st.integers(1, self.small_max)))
        stream = self.memory.streams[stream_index]
        self.ops += 1
        free_chunks = CHUNKS - self.used_chunks()
        need = 1 if size <= self.small_max else -(-size // self.chunk)
        try:
            addr = self.arena.malloc(size, stream)
        except vmalloc.OutOfMemoryError:
            assert need > free_chunks, f"OOM for {need} chunks while {free_chunks} were free"
            return
        self.memory.handed_out(stream, addr, size)
        self.serial += 1
        tag = self.serial % 251 + 1
        self.memory.write(stream, addr, size, tag)
        self.live[addr] = (size, stream, tag)
        if share == 0:  # also used on another stream: record_stream
            other = self.memory.streams[(stream_index + 1) % 3]
            self.memory.use_on(stream, other, addr, size, tag)
            self.arena.record_stream(addr, other)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        addr = data.draw(st.sampled_from(sorted(self.live)))
        self.ops += 1
        size, stream, tag = self.live.pop(addr)
        self.memory.check(stream, addr, size, tag)
        self.arena.free(addr)

    @rule()
    def empty_cache(self):
        self.ops += 1
        self.arena.empty_cache()
        s = self.arena.stats()
        assert s["num_cached_chunks"] == s["num_empty_slabs"] == s["num_releasable_chunks"] == 0
        assert s["pending_free_bytes"] == 0
        # Memory goes back in whole blocks (Note [Blocks and slices]): what stays free belongs to blocks that
        # also hold chunks in use: at most all but one chunk of each.
        assert s["num_pool_chunks"] <= s["num_blocks"] * (s["block_size"] // self.chunk - 1)
        if s["allocation.all.current"] == 0:
            assert s["reserved_bytes.all.current"] == 0

    @invariant()
    def consistent(self):
        self.arena.check_invariants()
        s = self.arena.stats()
        capacity = CHUNKS * self.chunk
        assert s["reserved_bytes.all.current"] <= capacity
        assert s["reserved_bytes.all.peak"] <= capacity
        # Live allocations never overlap.
        spans = sorted((a, a + size) for a, (size, _, _) in self.live.items())
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
        # Each keeps its pattern (on the emulated driver: checked by stream work when freed).
        if isinstance(self.memory, HostMemory):
            for addr, (size, stream, tag) in self.live.items():
                self.memory.check(stream, addr, size, tag)
        # Stats equal a recount: from our own books and from the snapshot.
        assert s["requested_bytes.all.current"] == sum(size for size, _, _ in self.live.values())
        assert s["allocation.all.current"] == len(self.live)
        snap = self.arena.snapshot()
        blocks = [b for seg in snap["segments"] for b in seg["blocks"]]
        allocated = [b for b in blocks if b["state"] == "active_allocated"]
        assert {b["address"] for b in allocated} == set(self.live)
        assert s["allocated_bytes.all.current"] == sum(b["size"] for b in allocated)
        active = [b for b in blocks if b["state"] != "inactive"]
        assert s["active_bytes.all.current"] == sum(b["size"] for b in active)
        assert s["mapped_bytes.all.current"] == sum(seg["total_size"] for seg in snap["segments"])
        assert s["reserved_bytes.all.current"] == s["mapped_bytes.all.current"] + s["num_pool_chunks"] * self.chunk
        assert s["num_alloc"] - s["num_free"] == len(self.live)

    def teardown(self):
        for addr, (size, stream, tag) in sorted(self.live.items()):
            self.memory.check(stream, addr, size, tag)
            self.arena.free(addr)
        self.arena.empty_cache()
        self.arena.check_invariants()
        del self.arena
        self.memory.finish()
        SUMMARY.count_ops(self.memory.name, self.ops)


class CudaArenaMachine(ArenaMachine):
    memory_type = FakeCudaMemory


ArenaMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)
CudaArenaMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=50, deadline=None)
TestArenaProperties = ArenaMachine.TestCase
TestCudaArenaProperties = pytest.mark.cuda_fake(CudaArenaMachine.TestCase)
