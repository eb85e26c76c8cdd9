"""Stream and capture semantics of the core on the host backend, with the test backend simulating events
(recorded events complete when the test says so, or when the allocator waits for them) and capture. The
same behaviour on the cuda backend, with real asynchrony and the race detector, is in test_cuda_fake.py."""

import pytest

import vmalloc

KiB = 1024
CHUNK = 64 * KiB


def arena(**kw):
    kw = {"backend": "host", "capacity": 16 * CHUNK, "chunk_size": CHUNK, "small_max": 16 * KiB, "mid_chunks": 0,
          "_test_backend": True, **kw}
    return vmalloc.Arena(**kw)


@pytest.mark.parametrize("size", [3 * CHUNK, 4 * KiB])
def test_record_stream_block_waits_for_the_other_stream_not_the_allocation_stream(size):
    a = arena()
    p = a.malloc(size, 1)
    a.record_stream(p, 2)
    a.free(p)
    s = a.stats()
    assert s["num_stream_waits"] == 0  # nothing is folded into stream 1
    assert s["pending_free_bytes"] > 0 and s["active_bytes.all.current"] == s["pending_free_bytes"]
    assert s["num_pending_frees"] == 1
    q = a.malloc(size, 1)  # stream 2's work may still read p: not reused
    assert q != p
    a._complete_events(2)
    a.free(q)
    r = a.malloc(size, 1)  # settled: p is reusable on stream 1 again
    assert a.stats()["pending_free_bytes"] == 0 and r in (p, q)
    a.free(r)
    a.check_invariants()
    assert a._host_waits() == 0


def test_pending_frees_are_waited_for_before_failing():
    a = arena(capacity=4 * CHUNK)
    p = a.malloc(4 * CHUNK, 1)
    a.record_stream(p, 2)
    a.free(p)
    q = a.malloc(4 * CHUNK, 1)  # everything is pending: the allocator waits (on the host) for stream 2
    assert q == p and a._host_waits() >= 1
    a.free(q)
    a.check_invariants()


def test_empty_cache_waits_for_pending_frees_and_snapshot_shows_them():
    a = arena(history=100)
    p = a.malloc(2 * CHUNK, 1)
    a.record_stream(p, 2)
    a.free(p)
    states = [state for *_, blocks in a._segments() for *_, state in blocks]
    assert states == ["active_pending_free"]
    actions = [e["action"] for e in a.snapshot()["device_traces"][0]]
    assert actions[-1] == "free_requested"  # completed only once stream 2 is done
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0 and a._host_waits() >= 1
    assert [e["action"] for e in a.snapshot()["device_traces"][0]][-2:] == ["free_completed", "segment_unmap"]


def test_malloc_on_a_capturing_stream_serves_only_its_cache():
    a = arena()
    a.free(a.malloc(4 * CHUNK, 1))
    a.free(a.malloc(1000, 1))
    a._set_capturing(1, True)
    calls = a._backend_calls()
    p = a.malloc(3 * CHUNK, 1)
    s = a.malloc(2000, 1)
    with pytest.raises(vmalloc.CaptureError, match="stream 0x1 while it is being captured"):
        a.malloc(2 * CHUNK, 1)
    after = a._backend_calls()
    assert {k: v for k, v in after.items() if k != "capturing"} == {k: v for k, v in calls.items() if k != "capturing"}
    a.free(p)
    a.free(s)
    st = a.stats()
    assert st["num_deferred_frees"] == 2 and st["num_capture_errors"] == 1 and st["allocation.all.current"] == 0
    assert st["active_bytes.all.current"] == 3 * CHUNK + 2048
    a.check_invariants()
    a._set_capturing(1, False)
    a.free(a.malloc(CHUNK, 0))  # the next call finds the capture over and settles the deferred frees
    assert a.stats()["active_bytes.all.current"] == 0
    a.check_invariants()


def test_a_free_whose_record_stream_stream_captures_is_deferred():
    a = arena()
    p = a.malloc(CHUNK, 1)
    a.record_stream(p, 2)
    a._set_capturing(2, True)
    a.free(p)
    assert a.stats()["num_deferred_frees"] == 1 and a._backend_calls().get("record_event", 0) == 0
    a._set_capturing(2, False)
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0


def test_announced_capture_keeps_the_cache_mapped():
    a = arena(capacity=4 * CHUNK)
    a.free(a.malloc(4 * CHUNK, 1))
    a.capture_begin()
    with pytest.raises(vmalloc.OutOfMemoryError):
        a.malloc(4 * CHUNK, 2)  # would reclaim stream 1's chunks
    a.empty_cache()
    assert a.stats()["num_cached_chunks"] == 4 and a._backend_calls().get("unmap", 0) == 0
    a.set_capacity(2 * CHUNK)  # cannot shrink now: allowed above the capacity until the capture ends
    a.check_invariants()
    a.capture_end()
    a.free(a.malloc(CHUNK, 1))  # a free above the capacity shrinks now
    assert a.stats()["reserved_bytes.all.current"] <= 2 * CHUNK
    a.check_invariants()


def test_call_oom_handler_false_and_the_thread_scope():
    a = arena(capacity=2 * CHUNK)
    calls = []
    a.set_oom_handler(lambda n: calls.append(n) or False)
    p = a.malloc(2 * CHUNK)
    with pytest.raises(vmalloc.OutOfMemoryError):
        a.malloc(CHUNK, call_oom_handler=False)
    assert calls == [] and a.stats()["num_oom_handler_calls"] == 0
    with pytest.raises(vmalloc.OutOfMemoryError):
        a.malloc(CHUNK)
    assert calls == [CHUNK]
    a.free(p)


def test_oom_message_on_host_keeps_vmallocs_own_words():
    a = arena(capacity=2 * CHUNK)
    with pytest.raises(vmalloc.OutOfMemoryError) as err:
        a.malloc(3 * CHUNK)
    assert str(err.value).startswith("vmalloc out of memory")  # "CUDA out of memory." only on cuda
