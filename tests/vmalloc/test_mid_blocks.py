"""Note [Mid-size blocks] (opt-in, mid_chunks=4): requests above small_max up to mid_chunks chunks are blocks of
mid slabs, rounded to a quarter chunk, not ranges rounded to whole chunks; the chunks of a slab that no block in
use touches are cut out when memory runs short, so a request still succeeds whenever enough chunks hold no data
in use."""

import ctypes
import random

import pytest

import vmalloc

KiB, MiB = 1024, 1 << 20
CHUNK = 64 * KiB  # host backend: mid requests are (16 KiB, 256 KiB], rounded to 16 KiB, in 256 KiB slabs


def host(chunks=32, **kw):
    return vmalloc.Arena("host", capacity=chunks * CHUNK, chunk_size=CHUNK, small_max=16 * KiB, mid_chunks=4, **kw)


def fill(addr, n, tag):
    ctypes.memset(addr, tag, n)


def holds(addr, n, tag):
    return ctypes.string_at(addr, n) == bytes([tag]) * n


def free_chunks(a):
    """Chunks that no block in use touches (as in test_properties.py)."""
    used = set()
    for seg, _size, _stream, _small, blocks in a._segments():
        for addr, size, _req, state in blocks:
            if state == "active_allocated":
                used.update(range((addr - seg) // CHUNK + seg // CHUNK, (addr + size - 1) // CHUNK + 1))
    return a.stats()["capacity"] // CHUNK - len(used)


def test_a_mid_request_is_rounded_to_a_quarter_chunk_and_shares_a_slab():
    a = vmalloc.Arena("sim", capacity="1GiB", mid_chunks=4)  # 2 MiB chunks: up to 8 MiB, in 512 KiB steps
    ps = [a.malloc(2 * MiB + 256 * KiB) for _ in range(3)]  # 2.25 MiB: 4 MiB each when rounded to chunks
    s = a.stats()
    assert s["allocated_bytes.all.current"] == 3 * (2 * MiB + 512 * KiB)
    assert s["reserved_bytes.all.current"] == 8 * MiB and s["slab_bytes.all.current"] == 8 * MiB
    assert len(a._segments()) == 1
    for p in ps:
        a.free(p)
    a.empty_cache()  # the empty slab is retired and released
    assert a.stats()["reserved_bytes.all.current"] == 0
    a.check_invariants()


@pytest.mark.parametrize("mid_chunks, fit", [(0, 8), (4, 12)])
def test_more_mid_tensors_fit_a_small_capacity(mid_chunks, fit):
    """The first GPU run's out-of-memory: tensors of 2.25 MiB under a small budget. Rounded to chunks, 32 MiB
    holds 8 of them; in mid slabs, 12."""
    a = vmalloc.Arena("sim", capacity="32MiB", mid_chunks=mid_chunks)
    n = 0
    try:
        while True:
            a.malloc(2 * MiB + 256 * KiB)
            n += 1
    except vmalloc.OutOfMemoryError:
        pass
    assert n == fit
    a.check_invariants()


def test_free_chunks_of_a_slab_in_use_are_cut_out_and_stitched_with_their_data_kept():
    a = host(chunks=12)
    blocks = [a.malloc(64 * KiB) for _ in range(4)]  # one 4-chunk slab, a block per chunk
    for i, p in enumerate(blocks):
        fill(p, 64 * KiB, i + 1)
    a.free(a.malloc(5 * CHUNK))  # large (above 4 chunks): cached
    a.free(blocks[1])
    a.free(blocks[2])  # the slab's middle chunks hold nothing now, its ends still do
    big = a.malloc(10 * CHUNK)  # 3 never created + 5 cached + the slab's 2 free chunks: all of them
    fill(big, 10 * CHUNK, 7)
    assert holds(blocks[0], 64 * KiB, 1) and holds(blocks[3], 64 * KiB, 4) and holds(big, 10 * CHUNK, 7)
    a.check_invariants()
    s = a.stats()
    assert s["slab_bytes.all.current"] == 2 * CHUNK and s["reserved_bytes.all.current"] == 12 * CHUNK
    for p in (blocks[0], blocks[3], big):
        a.free(p)
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0
    a.check_invariants()


def test_a_slab_is_as_small_as_the_request_when_its_full_size_is_not_free():
    a = host(chunks=7)
    big = a.malloc(5 * CHUNK)
    p = a.malloc(100 * KiB)  # needs 2 chunks; a 4-chunk slab cannot be had
    fill(p, 100 * KiB, 3)
    assert a.stats()["slab_bytes.all.current"] == 2 * CHUNK and holds(p, 100 * KiB, 3)
    a.free(big)
    a.free(p)
    a.check_invariants()


@pytest.mark.parametrize("seed", range(4))
def test_a_request_as_large_as_the_chunks_holding_nothing_succeeds(seed):
    """The fragmentation test with mid slabs: fill with mixed sizes (small, mid, large), free every other,
    then ask for every chunk that holds no data in use, in one allocation."""
    rng = random.Random(seed)
    a = host(chunks=64)
    live = []
    while True:
        size = rng.choice([rng.randint(1, 16 * KiB), rng.randint(16 * KiB + 1, 4 * CHUNK), rng.randint(1, 6) * CHUNK])
        try:
            p = a.malloc(size)
        except vmalloc.OutOfMemoryError:
            break
        fill(p, size, len(live) % 251 + 1)
        live.append((p, size, len(live) % 251 + 1))
    for p, _, _ in live[::2]:
        a.free(p)
    kept = live[1::2]
    n = free_chunks(a)
    assert n > 0
    big = a.malloc(n * CHUNK)
    fill(big, n * CHUNK, 250)
    assert all(holds(p, size, tag) for p, size, tag in kept)
    a.check_invariants()
