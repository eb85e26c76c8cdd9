"""Note [Blocks and slices]: physical memory is created in blocks of several chunks; a chunk is a slice of a
block, and a run of a block's slices maps with one backend call. The chunk stays the unit of capacity, the
pool, reclaim and the guarantees; memory goes back to the backend in whole blocks."""

import ctypes
import random

import pytest
from arena_workload import Workload
from backends import HostMemory

import vmalloc

KiB = 1024
CHUNK = 64 * KiB
OPS = ["create_chunk", "map", "set_access", "unmap", "release_chunk"]


def arena(chunks=32, block=8, **kw):
    kw = {"capacity": chunks * CHUNK, "chunk_size": CHUNK, "small_max": 16 * KiB, "block_size": block * CHUNK,
          "mid_chunks": 0, **kw}  # fmt: skip
    return vmalloc.Arena("host", **kw)


def fill(addr, n, tag):
    ctypes.memset(addr, tag, n)


def holds(addr, n, tag):
    return ctypes.string_at(addr, n) == bytes([tag]) * n


def calls(a):
    s = a.stats()
    return {k: s[k] for k in ("num_device_alloc", "num_maps", "num_set_access", "num_unmaps", "num_device_free")}


def test_a_request_is_one_block_mapped_with_one_call():
    a = arena()
    p = a.malloc(6 * CHUNK)
    fill(p, 6 * CHUNK, 1)
    assert holds(p, 6 * CHUNK, 1)
    assert calls(a) == {"num_device_alloc": 1, "num_maps": 1, "num_set_access": 1, "num_unmaps": 0,
                        "num_device_free": 0}
    s = a.stats()
    assert s["num_blocks"] == 1 and s["num_mapped_chunks"] == s["num_created_chunks"] == 6
    q = a.malloc(20 * CHUNK)  # more than a block: blocks of at most 8 chunks, one map each
    fill(q, 20 * CHUNK, 2)
    assert holds(p, 6 * CHUNK, 1) and holds(q, 20 * CHUNK, 2)
    s = a.stats()
    assert (s["num_blocks"], s["num_maps"], s["num_set_access"]) == (4, 4, 2)
    a.check_invariants()


def test_one_chunk_blocks_map_chunk_by_chunk():
    a = arena(block=1)
    a.malloc(6 * CHUNK)
    s = a.stats()
    assert (s["num_blocks"], s["num_maps"], s["num_set_access"], s["block_size"]) == (6, 6, 1, CHUNK)


def test_chunks_reclaimed_from_part_of_a_mapping_move_with_their_data():
    """A cached range is split (its mapping now serves a live allocation and free chunks): reclaiming the
    free part for another stream unmaps nothing (the mapping still holds the live chunks; the reclaimed ones
    stay mapped there, unused) and maps them elsewhere as one run. The mapping goes once all its chunks left
    their ranges."""
    a = arena(growth_slack=0)  # no growth past the high-water mark: the miss reclaims (Note [Reuse before growth])
    a.free(a.malloc(8 * CHUNK, 0))  # one block, one mapping, cached on stream 0
    head = a.malloc(3 * CHUNK, 0)  # best fit: the cached range, split
    fill(head, 3 * CHUNK, 7)
    before = calls(a)
    tail = a.malloc(5 * CHUNK, 1)  # another stream: no pool, no room to create... the cache's 5 chunks
    a.check_invariants()
    after = calls(a)
    assert after["num_unmaps"] == before["num_unmaps"] and after["num_maps"] == before["num_maps"] + 1
    s = a.stats()
    assert s["num_idle_mapped_chunks"] == 5 and s["num_chunks"] == 8 and s["num_mappings"] == 2
    fill(tail, 5 * CHUNK, 9)
    assert holds(head, 3 * CHUNK, 7) and holds(tail, 5 * CHUNK, 9)
    a.free(head)
    a.empty_cache()  # head's chunks leave: the first mapping is unmapped; the block still serves tail
    s = a.stats()
    assert s["num_idle_mapped_chunks"] == 0 and s["num_mappings"] == 1 and s["num_chunks"] == 8
    assert s["num_pool_chunks"] == 3 and s["num_releasable_chunks"] == 0  # returned in whole blocks only
    assert holds(tail, 5 * CHUNK, 9)
    a.free(tail)
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0
    a.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_any_k_free_chunks_serve_k_across_blocks_and_mappings(seed):
    """The guarantee with blocks: however the free chunks lie (split ranges, parts of mappings, several
    blocks, several streams), a request for as many chunks as are free succeeds, and data stays intact."""
    rng = random.Random(seed)
    a = arena(chunks=48)
    live = {}
    while True:
        n = rng.randint(1, 7)
        try:
            p = a.malloc(n * CHUNK, rng.choice([0, 1, 2]))
        except vmalloc.OutOfMemoryError:
            break
        fill(p, n * CHUNK, len(live) % 250 + 1)
        live[p] = (n, len(live) % 250 + 1)
    for p in rng.sample(sorted(live), len(live) // 2):
        a.free(p)
        del live[p]
    for _ in range(3):  # reuse and split some of the cache, so mappings straddle live and free chunks
        n = rng.randint(1, 3)
        p = a.malloc(n * CHUNK, rng.choice([0, 1, 2]))
        fill(p, n * CHUNK, 251)
        live[p] = (n, 251)
    free = 48 - sum(n for n, _ in live.values())
    assert free > 0
    big = a.malloc(free * CHUNK, 3)  # a stream that caches nothing: every free chunk is reclaimed
    fill(big, free * CHUNK, 252)
    a.check_invariants()
    assert all(holds(p, n * CHUNK, tag) for p, (n, tag) in live.items())
    with pytest.raises(vmalloc.OutOfMemoryError):
        a.malloc(CHUNK, 3)
    a.free(big)
    for p in live:
        a.free(p)
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0


def test_capacity_shrinks_in_whole_blocks():
    a = arena(chunks=32)
    p = a.malloc(8 * CHUNK)  # block A
    a.free(a.malloc(8 * CHUNK))  # block B, cached
    keep = a.malloc(2 * CHUNK)  # best fit: B's range split; B holds 2 chunks in use
    fill(keep, 2 * CHUNK, 4)
    a.set_capacity(12 * CHUNK)  # B cannot go (a chunk is in use), A can only go when freed
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 16 * CHUNK and s["num_cached_chunks"] == 0
    a.check_invariants()  # above the capacity with nothing releasable: allowed
    a.free(p)  # A is wholly free now: released
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 8 * CHUNK <= s["capacity"] and s["num_blocks"] == 1
    assert holds(keep, 2 * CHUNK, 4)
    q = a.malloc(6 * CHUNK, 1)  # B's six free chunks serve
    assert a.stats()["num_blocks"] == 1
    with pytest.raises(vmalloc.OutOfMemoryError):
        a.malloc(5 * CHUNK, 1)  # 8 held: only 4 more fit under the capacity
    r = a.malloc(4 * CHUNK, 1)
    assert a.stats()["reserved_bytes.all.current"] == 12 * CHUNK
    for x in (q, r, keep):
        a.free(x)
    a.check_invariants()


def test_a_refused_block_is_retried_half_as_large():
    a = arena(_test_backend=True)
    a._inject_fault("create_chunk", nth=1)  # the device refuses 8 chunks at once (out of memory)
    p = a.malloc(8 * CHUNK)
    fill(p, 8 * CHUNK, 3)
    s = a.stats()
    assert s["num_blocks"] == 2 and s["num_created_chunks"] == 8 and s["num_maps"] == 2
    assert s["num_backend_errors"] == 1 and "create_chunk failed" in a.last_backend_error
    a.check_invariants()


def scenario(a, errors):
    """Fragments blocks and mappings: splits, a reclaim of part of a mapping, growth in place, a reclaim of
    whole mappings, a capacity change and empty_cache. A backend error is recorded in `errors` and the
    scenario goes on. Returns its live allocations (addr -> (n, tag))."""
    live = {}

    def attempt(fn, *args):
        try:
            fn(*args)
        except vmalloc.BackendError as e:
            errors.append(str(e))
            a.check_invariants()

    def take(n, stream, tag):
        try:
            p = a.malloc(n * CHUNK, stream)
        except vmalloc.OutOfMemoryError:
            return
        fill(p, n * CHUNK, tag)
        live[p] = (n, tag)

    def drop(p):
        n, tag = live[p]
        assert holds(p, n * CHUNK, tag)
        a.free(p)
        del live[p]

    attempt(take, 8, 0, 1)
    attempt(take, 6, 0, 2)
    attempt(take, 4, 1, 3)
    for p in sorted(live)[:2]:
        attempt(drop, p)
    attempt(take, 3, 0, 4)  # splits a cached range of stream 0
    attempt(take, 7, 1, 5)  # stream 1: grows its range, or reclaims stream 0's
    attempt(take, 10, 2, 6)
    for p in sorted(live)[::2]:
        attempt(drop, p)
    attempt(take, 12, 2, 7)
    attempt(a.set_capacity, 20 * CHUNK)
    attempt(take, 6, 1, 8)
    attempt(a.empty_cache)
    attempt(take, 9, 0, 9)
    for p in sorted(live)[1:]:
        attempt(drop, p)
    attempt(a.set_capacity, 12 * CHUNK)  # releases whole blocks, unmapping what they still map
    attempt(a.empty_cache)
    return live


@pytest.mark.parametrize("op", OPS)
def test_fault_sweep_over_block_paths(op):
    """Each backend call of the scenario fails once, in turn: the error names the call, the arena stays
    consistent with every live allocation's data intact and usable, and it gives everything back at the
    end."""
    clean = arena(chunks=32, _test_backend=True)
    scenario(clean, [])
    total = clean._backend_calls().get(op, 0)
    assert total > 0, f"the scenario never calls {op}"
    fired = 0
    for nth in range(1, total + 1):
        a = arena(chunks=32, _test_backend=True)
        a._inject_fault(op, nth=nth, out_of_memory=False)
        errors = []
        live = scenario(a, errors)
        fired += a._faults_fired()
        assert all(f"{op} failed" in e for e in errors), errors
        a.check_invariants()
        a._clear_faults()
        for p, (n, tag) in live.items():
            assert holds(p, n * CHUNK, tag)
        a.set_capacity(32 * CHUNK)
        w = Workload(a, HostMemory(), seed=nth)  # still usable afterwards
        w.run(30)
        w.drain()
        for p in live:
            a.free(p)
        a.empty_cache()
        s = a.stats()
        assert s["reserved_bytes.all.current"] == 0 and s["num_mappings"] == 0, (op, nth, s)
    assert fired == total
