"""Streams are asynchronous workers: work runs in order, later than it is enqueued; events, waits, queries
and synchronization behave as the driver's; the legacy stream synchronizes with blocking streams; stream
capture is reported and refuses synchronizing calls."""

import ctypes
import threading

import pytest

from fakecuda.api import (
    CU_STREAM_CAPTURE_MODE_RELAXED,
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
    CU_STREAM_CAPTURE_STATUS_ACTIVE,
    CU_STREAM_CAPTURE_STATUS_INVALIDATED,
    CU_STREAM_CAPTURE_STATUS_NONE,
    CU_STREAM_LEGACY,
    CUDA_ERROR_CAPTURED_EVENT,
    CUDA_ERROR_INVALID_CONTEXT,
    CUDA_ERROR_INVALID_HANDLE,
    CUDA_ERROR_NOT_READY,
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
    CUDA_SUCCESS,
)

SLOW = 250_000  # us: long enough that the host surely looks before the work runs, even on a loaded machine


@pytest.fixture
def mem(fakecuda):
    """One mapped, accessible granule: its address."""
    g = fakecuda.granularity()
    ptr, handle = fakecuda.map_new(g)
    yield ptr
    fakecuda.ctx_synchronize()
    fakecuda.unmap_free(ptr, g, handle)


def test_work_runs_later_and_in_order(fakecuda, mem, streams):
    s = streams()
    fakecuda.fill(s, mem, 4096, 0x11, SLOW)
    fakecuda.expect(s, mem, 4096, 0x11)
    fakecuda.fill(s, mem, 100, 0x22)
    fakecuda.expect(s, mem, 100, 0x22)
    out = fakecuda.read(s, mem, 200)
    assert fakecuda.peek(mem, 1) == b"\0"  # the slow fill has not run yet
    assert not fakecuda.stream_done(s)
    fakecuda.synchronize(s)
    assert fakecuda.stream_done(s)
    assert out.raw == b"\x22" * 100 + b"\x11" * 100
    assert fakecuda.peek(mem, 101) == b"\x22" * 100 + b"\x11"


def test_event_query_is_not_ready_until_the_work_before_it_ran(fakecuda, mem, streams):
    s, e = streams(), fakecuda.event()
    fakecuda.fill(s, mem, 64, 0x33, SLOW)
    fakecuda.record(e, s)
    assert fakecuda.call("cuEventQuery", e) == CUDA_ERROR_NOT_READY
    fakecuda.event_synchronize(e)
    assert fakecuda.call("cuEventQuery", e) == CUDA_SUCCESS
    assert fakecuda.peek(mem, 64) == b"\x33" * 64
    fresh = fakecuda.event()  # never recorded: complete, as on a GPU
    assert fakecuda.call("cuEventQuery", fresh) == CUDA_SUCCESS
    fakecuda.event_synchronize(fresh)
    fakecuda.destroy_event(e)
    fakecuda.destroy_event(fresh)
    assert fakecuda.call("cuEventQuery", e) == CUDA_ERROR_INVALID_HANDLE


def test_wait_event_orders_another_stream(fakecuda, mem, streams):
    producer, consumer, e = streams(), streams(), fakecuda.event()
    fakecuda.fill(producer, mem, 4096, 0x44, SLOW)
    fakecuda.record(e, producer)
    fakecuda.wait_event(consumer, e)
    fakecuda.expect(consumer, mem, 4096, 0x44)  # would see zeros without the wait
    fakecuda.synchronize(consumer)
    fakecuda.destroy_event(e)


def test_without_a_wait_the_other_stream_runs_first(fakecuda, mem, streams):
    producer, consumer = streams(), streams()
    fakecuda.fill(producer, mem, 4096, 0x55, SLOW)
    fakecuda.expect(consumer, mem, 4096, 0x55)
    assert sorted(fakecuda.take_violations()) == ["data-mismatch", "stream-race"]


def test_legacy_stream_synchronizes_with_blocking_streams_only(fakecuda, mem, streams):
    blocking, nonblocking = streams(), streams(nonblocking=True)
    fakecuda.fill(blocking, mem, 64, 0x66, SLOW)
    fakecuda.expect(0, mem, 64, 0x66)  # the legacy stream waits for the blocking stream's work
    fakecuda.fill(0, mem, 64, 0x67, SLOW)
    fakecuda.expect(blocking, mem, 64, 0x67)  # and the blocking stream for the legacy stream's
    fakecuda.synchronize(blocking)
    assert fakecuda.violations() == []
    fakecuda.fill(nonblocking, mem, 64, 0x68, SLOW)
    fakecuda.expect(CU_STREAM_LEGACY, mem, 64, 0x68)  # no implicit wait on a non-blocking stream
    assert sorted(fakecuda.take_violations()) == ["data-mismatch", "stream-race"]


def test_destroyed_stream_finishes_its_work(fakecuda, mem):
    s = fakecuda.stream()
    fakecuda.fill(s, mem, 64, 0x77, SLOW)
    e = fakecuda.event()
    fakecuda.record(e, s)
    fakecuda.destroy_stream(s)  # returns at once
    assert fakecuda.call("cuStreamSynchronize", s) == CUDA_ERROR_INVALID_HANDLE
    assert fakecuda.call("cuEventQuery", e) == CUDA_ERROR_NOT_READY
    fakecuda.event_synchronize(e)
    assert fakecuda.peek(mem, 64) == b"\x77" * 64
    fakecuda.destroy_event(e)


def test_ctx_synchronize_waits_for_every_stream(fakecuda, mem, streams):
    a, b = streams(), streams(nonblocking=True)
    fakecuda.fill(a, mem, 64, 0x01, SLOW)
    fakecuda.fill(b, mem + 64, 64, 0x02, SLOW)
    fakecuda.ctx_synchronize()
    assert fakecuda.peek(mem, 128) == b"\x01" * 64 + b"\x02" * 64


def test_copy_between_device_ranges(fakecuda, mem, streams):
    s = streams()
    fakecuda.fill(s, mem, 256, 0x5A)
    fakecuda.copy(s, mem + 4096, mem, 256, 1000)
    fakecuda.expect(s, mem + 4096, 256, 0x5A)
    fakecuda.synchronize(s)


def test_the_legacy_stream_needs_a_current_context(fakecuda):
    result = []
    t = threading.Thread(target=lambda: result.append(fakecuda.call("cuStreamSynchronize", 0)))
    t.start()
    t.join()
    assert result == [CUDA_ERROR_INVALID_CONTEXT]
    assert fakecuda.call("cuStreamSynchronize", 2) == CUDA_ERROR_INVALID_HANDLE  # CU_STREAM_PER_THREAD
    assert fakecuda.call("cuStreamSynchronize", 0xDEAD0) == CUDA_ERROR_INVALID_HANDLE


def test_streams_from_many_threads(fakecuda):
    g = fakecuda.granularity()
    ptr, handle = fakecuda.map_new(8 * g)
    errors = []

    def worker(i):
        try:
            fakecuda.make_current(0)
            s = fakecuda.stream()
            base = ptr + i * g
            for k in range(60):
                fakecuda.fill(s, base, g // 4, k, 50 if k % 7 == 0 else 0)
                fakecuda.expect(s, base, g // 4, k)
                if k % 10 == 0:
                    fakecuda.synchronize(s)
            fakecuda.synchronize(s)
            fakecuda.destroy_stream(s)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    fakecuda.unmap_free(ptr, 8 * g, handle)


def test_capture_is_reported(fakecuda, mem, streams):
    s = streams()
    assert fakecuda.capture_status(s) == CU_STREAM_CAPTURE_STATUS_NONE
    fakecuda.begin_capture(s)
    assert fakecuda.capture_status(s) == CU_STREAM_CAPTURE_STATUS_ACTIVE
    status, ident = ctypes.c_int(), ctypes.c_ulonglong()
    assert fakecuda.call("cuStreamGetCaptureInfo_v2", s, ctypes.byref(status), ctypes.byref(ident),
                         None, None, None) == CUDA_SUCCESS
    assert status.value == CU_STREAM_CAPTURE_STATUS_ACTIVE and ident.value > 0
    fakecuda.fill(s, mem, 64, 0x99)  # captured, not run
    assert fakecuda.end_capture(s) == CUDA_SUCCESS
    assert fakecuda.capture_status(s) == CU_STREAM_CAPTURE_STATUS_NONE
    fakecuda.synchronize(s)
    assert fakecuda.peek(mem, 1) == b"\0"


def test_synchronizing_during_a_global_capture_invalidates_it(fakecuda, streams):
    s, other = streams(), streams()
    fakecuda.begin_capture(s)
    assert fakecuda.call("cuStreamSynchronize", other) == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    assert fakecuda.capture_status(s) == CU_STREAM_CAPTURE_STATUS_INVALIDATED
    assert fakecuda.call("fakecuda_fill", s, 0, 1, 0, 0) == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    assert fakecuda.end_capture(s) == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    fakecuda.synchronize(other)


def test_capture_modes(fakecuda, streams):
    s, other = streams(), streams()
    fakecuda.begin_capture(s, CU_STREAM_CAPTURE_MODE_RELAXED)
    fakecuda.synchronize(other)  # relaxed: allowed
    assert fakecuda.call("cuStreamQuery", s) == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED  # but never the capturing one
    assert fakecuda.end_capture(s) == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    fakecuda.begin_capture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    result = []

    def elsewhere():
        fakecuda.make_current(0)
        result.append(fakecuda.call("cuCtxSynchronize"))

    t = threading.Thread(target=elsewhere)
    t.start()
    t.join()
    assert result == [CUDA_SUCCESS]  # another thread may synchronize
    assert fakecuda.call("cuCtxSynchronize") == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED  # the capturing one not
    assert fakecuda.end_capture(s) == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED


def test_events_recorded_in_a_capture_cannot_be_queried(fakecuda, streams):
    s, joiner, e = streams(), streams(), fakecuda.event()
    fakecuda.begin_capture(s, CU_STREAM_CAPTURE_MODE_RELAXED)
    fakecuda.record(e, s)
    assert fakecuda.call("cuEventQuery", e) == CUDA_ERROR_CAPTURED_EVENT
    fakecuda.wait_event(joiner, e)  # joins the capture
    assert fakecuda.capture_status(joiner) == CU_STREAM_CAPTURE_STATUS_ACTIVE
    assert fakecuda.end_capture(s) == CUDA_SUCCESS
    assert fakecuda.capture_status(joiner) == CU_STREAM_CAPTURE_STATUS_NONE
    assert fakecuda.call("cuEventSynchronize", e) == CUDA_ERROR_CAPTURED_EVENT
    fakecuda.record(e, s)  # recorded outside a capture again: usable
    fakecuda.event_synchronize(e)
    fakecuda.destroy_event(e)


def test_legacy_stream_during_a_blocking_capture(fakecuda, streams):
    s, nonblocking = streams(), streams(nonblocking=True)
    fakecuda.begin_capture(nonblocking, CU_STREAM_CAPTURE_MODE_RELAXED)
    status = ctypes.c_int()
    assert fakecuda.call("cuStreamIsCapturing", 0, ctypes.byref(status)) == CUDA_SUCCESS  # non-blocking: fine
    assert fakecuda.end_capture(nonblocking) == CUDA_SUCCESS
    fakecuda.begin_capture(s, CU_STREAM_CAPTURE_MODE_RELAXED)
    assert fakecuda.call("cuStreamIsCapturing", 0, ctypes.byref(status)) == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
    e = fakecuda.event()
    assert fakecuda.call("cuEventRecord", e, 0) == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
    assert fakecuda.capture_status(s) == CU_STREAM_CAPTURE_STATUS_INVALIDATED
    assert fakecuda.end_capture(s) == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    fakecuda.destroy_event(e)
