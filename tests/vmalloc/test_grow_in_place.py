"""Note [Grow in place]: a request that no cached range of its stream can hold extends the stream's largest
cached range that has free address space around it, mapping only the chunks it lacks; fresh ranges of 16
chunks or more are placed with room around them (Note [Spread placement])."""

import ctypes

from arena_workload import Workload
from backends import HostMemory

import vmalloc

KiB = 1024
CHUNK = 64 * KiB


def arena(chunks: int = 64) -> vmalloc.Arena:
    return vmalloc.Arena("host", capacity=chunks * CHUNK, chunk_size=CHUNK, small_max=16 * KiB)


def fill(addr: int, n: int, tag: int) -> None:
    ctypes.memset(addr, tag, n)


def holds(addr: int, n: int, tag: int) -> bool:
    return ctypes.string_at(addr, n) == bytes([tag]) * n


def counts(a: vmalloc.Arena) -> tuple[int, int]:
    """Chunks mapped and unmapped so far (the calls are fewer: Note [Blocks and slices])."""
    s = a.stats()
    return s["num_mapped_chunks"], s["num_unmapped_chunks"]


def test_a_cached_range_grows_to_the_right_mapping_only_what_it_lacks():
    a = arena()
    x = a.malloc(20 * CHUNK)
    a.free(x)
    maps, unmaps = counts(a)
    y = a.malloc(24 * CHUNK)
    assert y == x  # the same range, four chunks longer
    assert counts(a) == (maps + 4, unmaps)
    fill(y, 24 * CHUNK, 7)  # every chunk mapped and writable
    assert holds(y, 24 * CHUNK, 7)
    a.check_invariants()


def test_growth_reclaims_only_the_shortfall_at_capacity():
    # 40 chunks of capacity, all in use; x (20) and z (4) freed; a 24-chunk request grows x by z's 4 chunks:
    # 4 unmapped, 4 mapped, where stitching used to unmap 24 and map 24. A request still succeeds whenever
    # enough chunks are free in total.
    a = arena(40)
    x, y, z = a.malloc(20 * CHUNK), a.malloc(16 * CHUNK), a.malloc(4 * CHUNK)
    fill(y, 16 * CHUNK, 9)
    a.free(x)
    a.free(z)
    maps, unmaps = counts(a)
    calls = a.stats()["num_maps"], a.stats()["num_unmaps"]
    w = a.malloc(24 * CHUNK)
    assert w == x and counts(a) == (maps + 4, unmaps + 4)
    assert (a.stats()["num_maps"], a.stats()["num_unmaps"]) == (calls[0] + 1, calls[1] + 1)  # z's block: one run
    fill(w, 24 * CHUNK, 3)
    assert holds(y, 16 * CHUNK, 9) and holds(w, 24 * CHUNK, 3)
    assert a.stats()["allocated_bytes.all.current"] == 40 * CHUNK
    a.check_invariants()


def test_a_range_whose_right_neighbour_is_taken_grows_to_the_left():
    a = arena()
    r = a.malloc(16 * CHUNK)  # placed with free address space on both sides
    a.free(r)
    head = a.malloc(8 * CHUNK)  # splits the cached range: [head | tail]
    tail = a.malloc(8 * CHUNK)
    assert (head, tail) == (r, r + 8 * CHUNK)
    fill(tail, 8 * CHUNK, 5)
    a.free(head)  # cached, with tail (live) on its right
    maps, _ = counts(a)
    g = a.malloc(12 * CHUNK)
    assert g == r - 4 * CHUNK and counts(a)[0] == maps + 4  # four chunks mapped before it
    fill(g, 12 * CHUNK, 6)
    assert holds(g, 12 * CHUNK, 6) and holds(tail, 8 * CHUNK, 5)
    a.check_invariants()


def test_random_large_requests_keep_data_and_invariants():
    a = arena(64)
    w = Workload(a, HostMemory(), seed=11, max_large=40, check_every=10)
    tally = w.run(600)
    w.drain()
    assert tally.ops == 600
    s = a.stats()
    assert s["num_maps"] > 0 and s["reserved_bytes.all.peak"] <= 64 * CHUNK
    a.check_invariants()
