"""The race detector flags memory unmapped, released or handed out while stream work that touches it is not
ordered before the new user, and unordered conflicting accesses; correctly ordered programs are not flagged."""

import pytest

SLOW = 250_000  # us: the host acts long before such work runs, even on a loaded machine


@pytest.fixture
def g(fakecuda):
    return fakecuda.granularity()


def test_unmap_with_pending_work_is_a_violation_with_context(fakecuda, g, streams):
    s = streams()
    ptr, handle = fakecuda.map_new(2 * g)
    fakecuda.fill(s, ptr + g, 4096, 0xAB, SLOW)
    fakecuda.unmap(ptr, 2 * g)
    fakecuda.drain()
    text = fakecuda.violations()
    assert fakecuda.take_violations() == ["unmap-pending", "illegal-address"]
    assert f"cuMemUnmap({ptr:#x}, {2 * g})" in text[0]
    assert "fill with 0xab of" in text[0] and f"{ptr + g:#x}" in text[0]  # the work item
    assert "stream 0x" in text[0] and "item #" in text[0]                # its stream and position
    assert "backtrace of the call" in text[0] and "cuMemUnmap" in text[0].split("backtrace")[1]
    assert "not mapped" in text[1] and "the work was skipped" in text[1]
    fakecuda.release(handle)
    fakecuda.free_reservation(ptr, 2 * g)


def test_finished_but_unsynchronized_work_is_still_a_race(fakecuda, g, streams):
    s = streams()
    ptr, handle = fakecuda.map_new(g)
    fakecuda.fill(s, ptr, 64, 1)
    fakecuda.drain()  # the work has run, but the host never waited for it: on a GPU it might not have
    fakecuda.unmap(ptr, g)
    assert fakecuda.take_violations() == ["unmap-pending"]
    fakecuda.release(handle)
    fakecuda.free_reservation(ptr, g)


@pytest.mark.parametrize("how", ["stream sync", "event sync", "event query", "ctx sync", "stream query"])
def test_unmap_after_the_host_waited_is_fine(fakecuda, g, streams, how):
    s = streams()
    ptr, handle = fakecuda.map_new(g)
    fakecuda.fill(s, ptr, 4096, 2, 20_000)
    e = fakecuda.event()
    fakecuda.record(e, s)
    if how == "stream sync":
        fakecuda.synchronize(s)
    elif how == "event sync":
        fakecuda.event_synchronize(e)
    elif how == "event query":
        while not fakecuda.event_done(e):
            pass
    elif how == "stream query":
        while not fakecuda.stream_done(s):
            pass
    else:
        fakecuda.ctx_synchronize()
    fakecuda.unmap_free(ptr, g, handle)
    fakecuda.destroy_event(e)


def test_release_of_a_mapped_handle_then_unmap_with_pending_work(fakecuda, g, streams):
    s = streams()
    ptr, handle = fakecuda.map_new(g)
    fakecuda.fill(s, ptr, 64, 3, SLOW)
    fakecuda.release(handle)  # legal, and no race yet: the memory lives while mapped
    assert fakecuda.violations() == []
    fakecuda.unmap(ptr, g)  # now the memory goes with work pending on it
    assert fakecuda.take_violations() == ["unmap-pending", "release-pending", "illegal-address"]
    fakecuda.free_reservation(ptr, g)


def test_reuse_without_a_wait_is_flagged(fakecuda, g, streams):
    old, new = streams(), streams()
    ptr, handle = fakecuda.map_new(g)
    fakecuda.fill(old, ptr, g, 4, SLOW)
    fakecuda.check_reuse(new, ptr + 4096, 4096)  # handed to `new` while `old` still writes there
    fakecuda.check_reuse(old, ptr, g)  # the same stream: ordered by the stream
    fakecuda.check_reuse(new, ptr + g - 1, 1)
    text = fakecuda.violations()
    assert fakecuda.take_violations() == ["reuse-unordered", "reuse-unordered"]
    assert "fakecuda_check_reuse" in text[0] and "fill with 0x4" in text[0]
    fakecuda.ctx_synchronize()
    fakecuda.unmap_free(ptr, g, handle)


def test_reuse_after_a_wait_is_fine_and_waits_are_transitive(fakecuda, g, streams):
    a, b, c = streams(), streams(), streams()
    ptr, handle = fakecuda.map_new(g)
    e1, e2 = fakecuda.event(), fakecuda.event()
    fakecuda.fill(a, ptr, g, 5, SLOW)
    fakecuda.record(e1, a)
    fakecuda.wait_event(b, e1)
    fakecuda.record(e2, b)
    fakecuda.wait_event(c, e2)  # c is ordered after a through b
    fakecuda.check_reuse(c, ptr, g)
    fakecuda.fill(c, ptr, g, 6)
    fakecuda.expect(c, ptr, g, 6)
    fakecuda.synchronize(c)
    assert fakecuda.peek(ptr, 1) == b"\x06"
    fakecuda.ctx_synchronize()
    fakecuda.unmap_free(ptr, g, handle)
    fakecuda.destroy_event(e1)
    fakecuda.destroy_event(e2)


def test_reuse_after_the_host_synchronized_is_fine(fakecuda, g, streams):
    a, b = streams(), streams()
    ptr, handle = fakecuda.map_new(g)
    fakecuda.fill(a, ptr, g, 7, 10_000)
    fakecuda.synchronize(a)
    fakecuda.check_reuse(b, ptr, g)
    fakecuda.fill(b, ptr, g, 8)  # the host's knowledge orders later work on every stream
    fakecuda.synchronize(b)
    fakecuda.unmap_free(ptr, g, handle)


def test_unordered_writes_from_two_streams_race_reads_do_not(fakecuda, g, streams):
    a, b = streams(), streams()
    ptr, handle = fakecuda.map_new(g)
    fakecuda.read(a, ptr, 128)
    fakecuda.read(b, ptr, 128)  # read / read: no race
    assert fakecuda.violations() == []
    fakecuda.fill(b, ptr + 64, 8, 9)  # write against a's unordered read
    text = fakecuda.violations()
    assert fakecuda.take_violations() == ["stream-race"]
    assert "new:   fill with 0x9" in text[0] and "other: read [" in text[0]
    fakecuda.fill(a, ptr + 1024, 8, 1)
    fakecuda.fill(b, ptr + 2048, 8, 1)  # disjoint bytes: no race
    fakecuda.ctx_synchronize()
    fakecuda.unmap_free(ptr, g, handle)


def test_work_on_memory_without_access_is_an_illegal_address(fakecuda, g, streams):
    s = streams()
    ptr = fakecuda.reserve(2 * g)
    handle = fakecuda.create(g)
    fakecuda.map(ptr, g, handle)  # mapped, no cuMemSetAccess
    fakecuda.fill(s, ptr, 16, 1)
    fakecuda.fill(s, ptr + g, 16, 1)  # not mapped at all
    fakecuda.set_access(ptr, g, flags=1)  # read-only
    fakecuda.expect(s, ptr, 16, 0)
    fakecuda.fill(s, ptr, 16, 1)
    fakecuda.synchronize(s)
    text = fakecuda.violations()
    assert fakecuda.take_violations() == ["illegal-address"] * 3
    assert "may not write" in text[0] and "not mapped" in text[1] and "may not write" in text[2]
    fakecuda.unmap(ptr, g)
    fakecuda.release(handle)
    fakecuda.free_reservation(ptr, 2 * g)


def test_handing_out_unmapped_memory_is_flagged(fakecuda, g, streams):
    s = streams()
    ptr = fakecuda.reserve(g)
    fakecuda.check_reuse(s, ptr, 512)
    assert fakecuda.take_violations() == ["reuse-inaccessible"]
    fakecuda.free_reservation(ptr, g)


def test_assert_no_violations_reports_them(fakecuda, g, streams):
    s = streams()
    ptr, handle = fakecuda.map_new(g)
    fakecuda.fill(s, ptr, 8, 1, SLOW)
    fakecuda.check_reuse(streams(), ptr, 8)
    with pytest.raises(AssertionError, match=r"1 violation\(s\):\n\n\[reuse-unordered\]"):
        fakecuda.assert_no_violations()
    fakecuda.reset()
    fakecuda.ctx_synchronize()
    fakecuda.unmap_free(ptr, g, handle)
