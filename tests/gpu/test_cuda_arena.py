"""DESIGN.md's allocator invariants on the cuda backend: real cuMemCreate/cuMemMap, data written and checked
by GPU work across reclaims, on several streams."""

import random

import pytest
import torch

import vmalloc
from bench.workloads import fragmentation_workload

from cuda_oracle import vmm_backed
from cuda_view import bytes_at

MiB = 1024 * 1024


def test_granularity_and_bad_chunk_size():
    a = vmalloc.Arena("cuda", capacity="64MiB")
    assert a.granularity % (2 * MiB) == 0 or (2 * MiB) % a.granularity == 0
    with pytest.raises(ValueError, match="granularity"):
        vmalloc.Arena("cuda", chunk_size=a.granularity + 4096)


def test_random_sequence_keeps_data_across_reclaims():
    """Live allocations never overlap and their data never changes, whatever reclaim unmaps and remaps;
    physical bytes stay within the capacity; counters match a recount."""
    cap = 256 * MiB
    arena = vmalloc.Arena("cuda", capacity=cap, chunk_size="2MiB")
    rng = random.Random(0)
    live = {}
    streams = [torch.cuda.Stream() for _ in range(2)]
    for step in range(1500):
        if live and (rng.random() < 0.45 or len(live) > 40):
            addr = rng.choice(sorted(live))
            size, tag, s = live.pop(addr)
            with torch.cuda.stream(s):
                ok = bool((bytes_at(addr, size) == tag).all())  # checked on its own stream, before the free
            assert ok, f"allocation {addr:#x} changed"
            arena.free(addr)
        else:
            size = rng.choice([rng.randint(1, 1 * MiB), rng.randint(1 * MiB, 40 * MiB)])
            s = rng.choice(streams)
            try:
                addr = arena.malloc(size, stream=s.cuda_stream)
            except vmalloc.OutOfMemoryError:
                continue
            for other, (osize, _, _) in live.items():
                assert addr + size <= other or other + osize <= addr, "live allocations overlap"
            tag = step % 251
            with torch.cuda.stream(s):
                bytes_at(addr, size).fill_(tag)  # asynchronous: frees and reclaims must order after it
            live[addr] = (size, tag, s)
        if step % 100 == 0:
            arena.check_invariants()
            assert arena.stats()["reserved_bytes.all.current"] <= cap
    torch.cuda.synchronize()
    for addr, (size, tag, _) in live.items():
        assert bool((bytes_at(addr, size) == tag).all())
        arena.free(addr)
    s = arena.stats()
    assert s["num_reclaims"] > 0, "the sequence should have exercised reclaim"
    assert s["reserved_bytes.all.peak"] <= cap
    arena.empty_cache()
    assert arena.stats()["reserved_bytes.all.current"] == 0
    arena.check_invariants()


def test_large_request_succeeds_whenever_free_chunks_suffice():
    cap = 512 * MiB
    arena = vmalloc.Arena("cuda", capacity=cap)  # kept alive for as long as its ranges are used
    kept_tags = []

    def tag(addr, size):
        kept_tags.append((addr, size, len(kept_tags) % 200 + 1))
        bytes_at(addr, size).fill_(kept_tags[-1][2])

    r = fragmentation_workload(arena, cap, seed=1, on_alloc=tag)
    assert r["ok"], r.get("error")
    assert r["stats"]["num_reclaims"] > 0
    bytes_at(r["big"], r["request"]).fill_(3)  # the stitched range is writable end to end
    torch.cuda.synchronize()
    for addr, size in r["kept"]:
        expected = next(t for a, s, t in kept_tags if a == addr)
        assert bool((bytes_at(addr, size) == expected).all()), "a kept allocation changed during reclaim"
    assert bool((bytes_at(r["big"], r["request"]) == 3).all())
    assert vmm_backed(r["big"]), "vmalloc's ranges are driver VMM mappings"
    arena.free(r["big"])
    for addr, _ in r["kept"]:
        arena.free(addr)
    arena.check_invariants()
    del arena  # only now: destroying the arena unmaps every range


def test_out_of_memory_and_bad_free_leave_the_arena_intact():
    arena = vmalloc.Arena("cuda", capacity="64MiB")
    a = arena.malloc(30 * MiB)
    bytes_at(a, 30 * MiB).fill_(7)
    before = arena.stats()
    with pytest.raises(vmalloc.OutOfMemoryError, match="CUDA out of memory|out of memory"):
        arena.malloc(40 * MiB)
    with pytest.raises(ValueError, match="not a live allocation"):
        arena.free(a + 4096)
    after = arena.stats()
    for key in ("allocated_bytes.all.current", "reserved_bytes.all.current", "segment.all.current"):
        assert after[key] == before[key], key
    torch.cuda.synchronize()
    assert bool((bytes_at(a, 30 * MiB) == 7).all())
    arena.free(a)
    with pytest.raises(ValueError):
        arena.free(a)  # double free
    arena.check_invariants()


def test_cross_stream_reuse_waits_for_the_first_stream():
    """A range freed on stream A with work still queued there is not handed to stream B's request (through
    reclaim) before that work is done: B's data is never overwritten by A's late kernel."""
    arena = vmalloc.Arena("cuda", capacity="16MiB", chunk_size="2MiB")
    a_stream, b_stream = torch.cuda.Stream(), torch.cuda.Stream()
    n = 16 * MiB
    addr = arena.malloc(n, stream=a_stream.cuda_stream)
    with torch.cuda.stream(a_stream):
        torch.cuda._sleep(50_000_000)  # keep stream A busy, then write
        bytes_at(addr, n).fill_(1)
    arena.free(addr)  # freed with the write still queued on A
    b = arena.malloc(n, stream=b_stream.cuda_stream)  # needs A's chunks: reclaim must fence A's free
    with torch.cuda.stream(b_stream):
        bytes_at(b, n).fill_(2)
    torch.cuda.synchronize()
    assert bool((bytes_at(b, n) == 2).all())
    arena.free(b)
    arena.check_invariants()
