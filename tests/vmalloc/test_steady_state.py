"""A repeated training step settles: once the cache holds its working set, an iteration makes no map, unmap
or set_access call and no host wait, and records a fence only every few frees (Note [Reuse before growth],
Note [Sparse fences]). The trace is a U-Net's training steps captured on the meta device; the test backend
plays a GPU that finishes an iteration's work only when the iteration ends (the training loop's
synchronize), so any wait inside an iteration is a host wait."""

from functools import cache

import pytest

import vmalloc
from bench.traces import capture
from swap.capture import ALLOC, FREE, ITER_END

FENCE_STRIDE = 32  # Allocator::kFenceStride


@cache
def trace():
    return capture("unet", 2, steps=6, progress=False)


def replay(**options):
    """Per iteration after the first: the arena's driver calls, host waits, event records and frees."""
    t = trace()
    a = vmalloc.Arena("sim", capacity=4 << 40, _test_backend=True, **options)
    addr, rows, last = {}, [], None

    def counters():
        s, c = a.stats(), a._backend_calls()
        return {"maps": s["num_maps"], "unmaps": s["num_unmaps"], "set_access": s["num_set_access"],
                "host_waits": a._host_waits(), "event_syncs": s["num_event_syncs"],
                "records": c.get("record_event", 0), "frees": s["num_free"]}  # fmt: skip

    for op, i, size, stream in zip(t.op.tolist(), t.id.tolist(), t.size.tolist(), t.stream.tolist()):
        if op == ALLOC:
            addr[i] = a.malloc(size, stream)
        elif op == FREE and i in addr:
            a.free(addr.pop(i))
        elif op == ITER_END:
            now = counters()
            if last is not None:
                rows.append({k: now[k] - last[k] for k in now})
            last = now
            a._complete_events()
    a.check_invariants()
    return rows, a.stats()


def test_steady_iterations_make_no_driver_call_and_no_host_wait():
    rows, s = replay()
    for row in rows[-3:]:
        assert row["maps"] == row["unmaps"] == row["set_access"] == 0, rows
        assert row["host_waits"] == row["event_syncs"] == 0, rows
        # One fence per FENCE_STRIDE frees of a stream, not one per free (the trace has one stream).
        assert row["records"] <= row["frees"] // FENCE_STRIDE + 1, rows
    # The price: reserved memory above the peak in use, within the growth slack (default 0.125).
    assert s["reserved_bytes.all.peak"] <= in_use_peak(s) * (1 + 0.125)


def in_use_peak(s):
    """An upper bound of the most memory in use at once: allocated bytes, plus whole slabs for small blocks."""
    return s["allocated_bytes.all.peak"] + s["slab_bytes.all.peak"]


@pytest.mark.parametrize("slack", [0, 0.5])
def test_growth_slack_bounds_reserved_memory(slack):
    rows, s = replay(growth_slack=slack)
    assert s["reserved_bytes.all.peak"] <= in_use_peak(s) * (1 + slack)
    if slack == 0:  # reuse before growth: reserved at the peak in use, at the price of reclaims
        assert sum(r["maps"] for r in rows[-3:]) > 0
