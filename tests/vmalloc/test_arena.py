"""The Arena API on the host backend: sizes, errors, free, OOM, the OOM handler, buffers."""

import pytest

import vmalloc

KiB, MiB = 1024, 1024 * 1024


def test_sizes_parse_and_round(make_arena):
    assert vmalloc.parse_size("512MiB") == 512 * MiB
    assert vmalloc.parse_size("1.5GiB") == 3 * 512 * MiB
    assert vmalloc.parse_size("10MB") == 10_000_000
    assert vmalloc.parse_size(4096) == 4096
    a = make_arena(capacity="4MiB", chunk_size="64KiB")
    assert a.capacity == 4 * MiB and a.chunk_size == 64 * KiB
    p = a.malloc(100)  # small: 512 B rounding
    q = a.malloc(100 * KiB)  # large: two 64 KiB chunks
    s = a.stats()
    assert s["requested_bytes.all.current"] == 100 + 100 * KiB
    assert s["allocated_bytes.all.current"] == 512 + 128 * KiB
    assert s["internal_fragmentation_bytes"] == 512 + 128 * KiB - 100 - 100 * KiB
    a.free(p)
    a.free(q)


@pytest.mark.parametrize("mid_chunks", [0, 4])
def test_allocation_size_is_what_allocated_bytes_counts(make_arena, mid_chunks):
    # A planner that budgets in allocated bytes sizes each tensor with it (a 2.25 MiB activation holds two
    # 2 MiB chunks): every request class, checked against the counter itself.
    a = make_arena(capacity="64MiB", chunk_size="1MiB", small_max="64KiB", mid_chunks=mid_chunks)
    mid = (lambda n: -(-n // (256 * KiB)) * 256 * KiB) if mid_chunks else (lambda n: -(-n // MiB) * MiB)
    expected = {0: 0, 1: 512, 513: 1024, 64 * KiB: 64 * KiB, 64 * KiB + 1: mid(64 * KiB + 1),
                MiB + 1: mid(MiB + 1), 4 * MiB: 4 * MiB, 4 * MiB + 1: 5 * MiB}  # fmt: skip
    for n, size in expected.items():
        before = a.allocated_bytes
        p = a.malloc(n)
        assert a.allocation_size(n) == size == a.allocated_bytes - before, n
        a.free(p)
    with pytest.raises((TypeError, ValueError)):
        a.allocation_size(-1)


def test_held_bytes_and_not_allocated_bytes_say_whether_a_request_fits(make_arena):
    # Note [Held bytes] in csrc/allocator.cpp: the free halves of slabs that keep a block in use count in no
    # allocation's bytes, and a large request cannot use them. Six 1 MiB slabs each keep one 512 KiB block:
    # 3 MiB allocated of an 8 MiB capacity, 6 MiB held.
    a = make_arena(capacity="8MiB", chunk_size="1MiB", small_max="512KiB")
    blocks = [a.malloc(512 * KiB) for _ in range(12)]
    for p in blocks[::2]:
        a.free(p)
    assert a.allocated_bytes == 3 * MiB and a.held_bytes == 6 * MiB == a.reserved_bytes
    assert a.allocated_bytes + a.allocation_size(3 * MiB) <= a.capacity  # fits by allocated bytes, yet:
    with pytest.raises(vmalloc.OutOfMemoryError):
        a.malloc(3 * MiB)
    assert a.held_bytes == 6 * MiB
    assert a.held_bytes + a.allocation_size(2 * MiB) <= a.capacity  # fits by held bytes, and is served
    big = a.malloc(2 * MiB)
    s = a.stats()
    assert a.held_bytes == s["held_bytes.all.current"] == 8 * MiB
    assert a.peak_held_bytes == s["held_bytes.all.peak"] == 8 * MiB
    a.free(big)
    for p in blocks[1::2][:3]:  # three slabs empty: their chunks are free again
        a.free(p)
    assert a.held_bytes == 3 * MiB and a.peak_held_bytes == 8 * MiB  # a peak lasts until reset_peak_stats
    a.reset_peak_stats()
    assert a.peak_held_bytes == 3 * MiB
    for p in blocks[1::2][3:]:
        a.free(p)
    assert a.held_bytes == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"chunk_size": 1000}, "not a multiple of the host backend's granularity"),
        ({"chunk_size": "64KiB", "small_max": "128KiB"}, "must not exceed chunk_size"),
        ({"capacity": "32KiB", "chunk_size": "64KiB", "small_max": 0}, "smaller than one chunk"),
        ({"capacity": "12 parsecs"}, "invalid size unit"),
        ({"capacity": -5}, "must not be negative"),
        ({"backend": "tpu"}, "choose 'cuda', 'host' or 'sim'"),
    ],
)
def test_bad_options_are_rejected_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        vmalloc.Arena(**{"backend": "host", **kwargs})


def test_capacity_type_is_checked():
    with pytest.raises(TypeError, match="int or a string"):
        vmalloc.Arena("host", capacity=1.5)


def test_zero_bytes_and_free_of_null(make_arena):
    a = make_arena()
    assert a.malloc(0) == 0
    a.free(0)
    assert a.stats()["num_alloc"] == 0


def test_invalid_and_double_free_change_nothing(make_arena):
    a = make_arena()
    p = a.malloc(200 * KiB)
    q = a.malloc(3 * KiB)
    a.free(q)
    before = a.stats()
    for bad in (q, p + 512, 12345):
        with pytest.raises(ValueError, match="not a live allocation"):
            a.free(bad)
    assert a.stats() == before
    a.check_invariants()
    a.free(p)


def test_oom_names_the_numbers_and_leaves_the_arena_usable(make_arena):
    a = make_arena(capacity="1MiB", chunk_size="64KiB")
    held = [a.malloc(300 * KiB) for _ in range(3)]  # 3 x 5 chunks = 15 of 16
    with pytest.raises(vmalloc.OutOfMemoryError) as err:
        a.malloc(200 * KiB)
    msg = str(err.value)
    assert isinstance(err.value, MemoryError)
    for number in (200 * KiB, 3 * 5 * 64 * KiB, 1 * MiB):  # request, allocated, capacity
        assert f"{number} bytes" in msg
    assert "cached free" in msg
    assert a.stats()["num_ooms"] == 1
    a.check_invariants()
    a.free(held[1])
    p = a.malloc(200 * KiB)  # fits now
    a.buffer(p, 200 * KiB)[:] = b"x" * (200 * KiB)
    for h in (held[0], held[2], p):
        a.free(h)


def test_request_above_capacity_fails_without_calling_the_handler(make_arena):
    a = make_arena(capacity="1MiB")
    calls = []
    a.set_oom_handler(lambda n: calls.append(n) or True)
    with pytest.raises(vmalloc.OutOfMemoryError):
        a.malloc(2 * MiB)
    assert calls == []


def test_oom_handler_frees_and_the_allocation_is_retried(make_arena):
    a = make_arena(capacity="1MiB", chunk_size="64KiB")
    victims = [a.malloc(256 * KiB) for _ in range(4)]
    calls = []

    def evict(nbytes: int) -> bool:
        calls.append(nbytes)
        a.free(victims.pop())  # re-entrant: the allocator is unlocked while the handler runs
        return True

    a.set_oom_handler(evict)
    p = a.malloc(200 * KiB)
    assert calls == [200 * KiB]
    s = a.stats()
    assert s["num_oom_handler_calls"] == 1 and s["num_alloc_retries"] == 1 and s["num_ooms"] == 0
    a.set_oom_handler(lambda n: False)  # "I freed nothing": no retry, a clean OOM
    with pytest.raises(vmalloc.OutOfMemoryError):
        a.malloc(300 * KiB)
    a.set_oom_handler(None)
    for v in victims + [p]:
        a.free(v)


def test_oom_handler_exception_propagates_and_state_is_intact(make_arena):
    a = make_arena(capacity="256KiB", chunk_size="64KiB")
    p = a.malloc(256 * KiB)

    def broken(n):
        raise KeyError("handler bug")

    a.set_oom_handler(broken)
    with pytest.raises(KeyError, match="handler bug"):
        a.malloc(64 * KiB)
    a.check_invariants()
    a.free(p)


def test_buffer_is_bounded_by_the_allocation(make_arena):
    a = make_arena()
    p = a.malloc(100 * KiB)
    assert len(a.buffer(p, 100 * KiB)) == 100 * KiB
    with pytest.raises(ValueError, match="not inside one live allocation"):
        a.buffer(p, 100 * KiB + 1)
    a.free(p)
    with pytest.raises(ValueError, match="not inside one live allocation"):
        a.buffer(p, 1)
    with pytest.raises(ValueError, match="needs the host backend"):
        vmalloc.Arena("sim").buffer(0, 1)


def test_chunk_data_moves_with_the_chunk_on_reclaim(make_arena):
    """Data written through one mapping reads back through a later mapping of the same chunk."""
    a = make_arena(capacity="256KiB", chunk_size="64KiB", small_max=0)
    ranges = [a.malloc(64 * KiB) for _ in range(4)]
    for i, p in enumerate(ranges):
        a.buffer(p, 64 * KiB)[:] = bytes([i + 1]) * (64 * KiB)
    for p in ranges:
        a.free(p)
    # All four chunks are cached in (merged) free ranges; 4 chunks on another stream must reclaim them.
    big = a.malloc(256 * KiB, stream=7)
    s = a.stats()
    assert s["num_reclaims"] == 1 and s["num_unmaps"] == 4 and s["num_device_alloc"] == 4
    data = bytes(a.buffer(big, 256 * KiB))
    # The chunks hold the old bytes (the allocator never clears memory), in whatever order they came back.
    assert sorted(data[i * 64 * KiB] for i in range(4)) == [1, 2, 3, 4]
    assert all(data[i * 64 * KiB : (i + 1) * 64 * KiB] == bytes([data[i * 64 * KiB]]) * (64 * KiB) for i in range(4))
    a.free(big)


def test_same_stream_reuses_cached_ranges_best_fit_and_splits(make_arena):
    a = make_arena(capacity="2MiB", chunk_size="64KiB", small_max=0)
    p = a.malloc(5 * 64 * KiB)
    a.free(p)
    q = a.malloc(2 * 64 * KiB)  # best fit: the cached 5-chunk range, split
    assert q == p
    s = a.stats()
    # One block of 5 chunks, mapped with one call (Note [Blocks and slices]).
    assert (s["num_maps"], s["num_mapped_chunks"], s["num_device_alloc"]) == (1, 5, 1)
    assert s["num_splits"] == 1 and s["num_cached_chunks"] == 3
    r = a.malloc(3 * 64 * KiB)
    assert r == p + 2 * 64 * KiB
    a.free(q)
    a.free(r)  # merges back into one 5-chunk range
    assert a.stats()["segment.all.current"] == 1


def test_empty_cache_returns_everything(make_arena):
    a = make_arena()
    ps = [a.malloc(n) for n in (100, 5 * KiB, 300 * KiB, 1 * MiB)]
    keep = ps.pop()
    for p in ps:
        a.free(p)
    a.empty_cache()
    s = a.stats()
    assert s["reserved_bytes.all.current"] == s["allocated_bytes.all.current"] == 1 * MiB
    assert s["num_device_free"] > 0
    a.free(keep)
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0


def test_single_counters_match_stats(make_arena):
    # allocated_bytes / peak_allocated_bytes / reserved_bytes read one counter each (the swap runtime's hot
    # path); they must agree with stats() through allocation, free, cache release and a peak reset.
    a = make_arena()

    def check():
        s = a.stats()
        assert a.allocated_bytes == s["allocated_bytes.all.current"]
        assert a.peak_allocated_bytes == s["allocated_bytes.all.peak"]
        assert a.reserved_bytes == s["reserved_bytes.all.current"]

    check()
    ps = [a.malloc(n) for n in (100, 5 * KiB, 300 * KiB, 1 * MiB)]
    check()
    assert a.allocated_bytes > 1 * MiB and a.peak_allocated_bytes == a.allocated_bytes
    a.free(ps.pop())
    check()
    assert a.peak_allocated_bytes > a.allocated_bytes and a.reserved_bytes > a.allocated_bytes
    a.reset_peak_stats()
    check()
    assert a.peak_allocated_bytes == a.allocated_bytes
    for q in ps:
        a.free(q)
    a.empty_cache()
    check()
    assert a.allocated_bytes == 0 and a.reserved_bytes == 0


def test_after_empty_cache_every_stream_keeps_a_slab_for_its_small_blocks(make_arena):
    # What torch.cuda.memory_reserved() reads through the adapter after empty_cache (tests/gpu/torch_worker.py
    # parity): each chunk still held lies in a large allocation, in a slab holding a block in use, or in the
    # pool (a block with a chunk in use is not released). Slabs are per stream, so two streams each holding a
    # few bytes keep two chunks: a bound of one slab (allocated + one chunk + the pool) failed on an H200,
    # where torch's generator left two 8-byte tensors on a side stream.
    a = make_arena(capacity=16 * MiB, chunk_size=64 * KiB, small_max=16 * KiB)
    keep = [a.malloc(8, stream=0), a.malloc(8, stream=1), a.malloc(100 * KiB, stream=0)]
    spare = [a.malloc(200 * KiB)] + [a.malloc(4 * KiB, stream=s) for s in (0, 1) for _ in range(20)]
    for p in spare:
        a.free(p)
    a.empty_cache()
    s = a.stats()
    chunk = s["chunk_size"]
    assert s["num_cached_chunks"] == 0 and s["num_releasable_chunks"] == 0, s
    assert s["slab_bytes.all.current"] == 2 * chunk, s
    large = a.allocation_size(100 * KiB)
    assert s["allocated_bytes.all.current"] == 2 * 512 + large
    assert s["reserved_bytes.all.current"] == large + s["slab_bytes.all.current"] + s["num_pool_chunks"] * chunk, s
    assert s["reserved_bytes.all.current"] > s["allocated_bytes.all.current"] + chunk + s["num_pool_chunks"] * chunk
    for p in keep:
        a.free(p)


def test_set_capacity_releases_cached_memory(make_arena):
    a = make_arena(capacity="2MiB", chunk_size="64KiB")
    ps = [a.malloc(256 * KiB) for _ in range(6)]
    for p in ps[:4]:
        a.free(p)
    a.set_capacity("768KiB")
    s = a.stats()
    assert s["capacity"] == 768 * KiB
    assert s["reserved_bytes.all.current"] <= 768 * KiB
    with pytest.raises(vmalloc.OutOfMemoryError):
        a.malloc(512 * KiB)
    for p in ps[4:]:
        a.free(p)


def test_record_stream_on_host_is_accepted(make_arena):
    a = make_arena()
    p = a.malloc(100 * KiB, stream=1)
    a.record_stream(p, 2)
    with pytest.raises(ValueError):
        a.record_stream(p + 1, 2)
    a.free(p)


def test_sim_backend_handles_paper_scale():
    a = vmalloc.Arena("sim", capacity="120GiB")
    assert a.chunk_size == 2 * MiB
    ps = [a.malloc(3 * 1024 * MiB + 17) for _ in range(39)]
    a.free(ps[3])
    assert a.malloc(3 * 1024 * MiB) == ps[3]
    with pytest.raises(ValueError, match="granularity"):
        vmalloc.Arena("sim", chunk_size="1MiB")
    a.check_invariants()


def test_largest_allocatable_is_what_a_request_can_get_within_the_workspace_limit():
    """What torch's cacheInfo reports to cuDNN's benchmark mode (Note [Workspace offers]): idle chunks stitch
    into one range, plus what may be created under the capacity; the swap runtime's budget caps it."""
    MiB = 1 << 20
    a = vmalloc.Arena("sim", capacity="1GiB")
    live = a.malloc(100 * MiB)
    a.free(a.malloc(300 * MiB, 1))  # cached on another stream: still offered (reclaim stitches it)
    assert a.largest_allocatable() == 1024 * MiB - 100 * MiB
    assert a.largest_allocatable(device_free=200 * MiB) == 300 * MiB + 200 * MiB  # creatable capped by the device
    a.set_workspace_limit(500 * MiB)  # e.g. the swap budget: allocated 100 MiB, so 400 MiB more at most
    assert a.workspace_limit == 500 * MiB and a.largest_allocatable() == 400 * MiB
    a.free(a.malloc(a.largest_allocatable()))  # the offer is real
    a.set_workspace_limit(50 * MiB)  # below what is allocated: nothing to offer
    assert a.largest_allocatable() == 0
    a.set_workspace_limit(None)
    assert a.workspace_limit is None and a.largest_allocatable() == 1024 * MiB - 100 * MiB
    a.free(live)
    a.check_invariants()
