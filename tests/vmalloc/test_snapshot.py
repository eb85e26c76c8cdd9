"""Snapshots use PyTorch's layout: torch's own memory-viz code renders them, every trace entry has the keys
the viewer reads, and ranges that were split or merged render across their whole history (Note [Snapshot
segments] in vmalloc/snapshot.py), checked with the viewer's data logic (memory_viz_replay.py)."""

import pickle

import pytest
from memory_viz_replay import ViewerError, check_renders

import vmalloc

from tests_support import SANITIZED_RUN

KiB, MiB = 1024, 1024 * 1024


def make_snapshot():
    a = vmalloc.Arena("host", capacity="32MiB", history=1000)
    ps = [a.malloc(n) for n in (100, 4000, 3 * MiB, 5 * MiB)]
    a.free(ps[1])
    a.free(ps[2])
    # Every free chunk, on another stream (so stream 0's cached range cannot grow in place): forces a
    # reclaim, segment_unmap + segment_map.
    a.malloc(24 * MiB - 1, 1)
    return a, a.snapshot()


def split_history_snapshot():
    """Ranges split, merged, partly unmapped, slabs, a pending free and an OOM, all in the trace."""
    chunk = 64 * KiB
    a = vmalloc.Arena("host", capacity=16 * chunk, chunk_size=chunk, small_max=16 * KiB, history=10_000,
                      _test_backend=True)
    big = a.malloc(6 * chunk, 1)
    a.free(big)
    x = a.malloc(2 * chunk, 1)  # split: [x | 4 chunks cached]
    y = a.malloc(3 * chunk, 1)  # split again
    s1, s2 = a.malloc(1000, 1), a.malloc(3000, 2)
    a.free(x)
    a.free(y)  # merges with its neighbours
    a.free(s1)
    z = a.malloc(9 * chunk, 2)  # reclaims stream 1's cache: tails unmapped, stitched into one range
    a.record_stream(z, 3)
    a.free(z)  # pending on stream 3
    with pytest.raises(vmalloc.OutOfMemoryError):
        a.malloc(17 * chunk, 2)
    a._complete_events()
    w = a.malloc(5 * chunk, 2)  # settles the pending free, then splits z's range
    a.free(s2)
    mid = a.snapshot()  # w's range and the rest of z's are still split
    a.free(w)
    a.empty_cache()
    a.malloc(chunk, 1)
    return mid, a.snapshot()


def test_snapshot_layout():
    a, snap = make_snapshot()
    assert set(snap) >= {"segments", "device_traces", "allocator_settings"}
    for seg in snap["segments"]:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        assert seg["segment_type"] in ("small", "large")
    actions = [e["action"] for e in snap["device_traces"][0]]
    assert {"alloc", "free_requested", "free_completed", "segment_map", "segment_unmap"} <= set(actions)
    assert a.stats()["allocated_bytes.all.current"] == sum(s["allocated_size"] for s in snap["segments"])


def test_every_trace_entry_has_the_keys_the_viewer_reads():
    snap = split_history_snapshot()[1]
    entries = snap["device_traces"][0]
    assert {e["action"] for e in entries} >= {"alloc", "free_requested", "free_completed", "segment_map",
                                              "segment_unmap", "oom"}
    for e in entries:
        assert {"action", "addr", "size", "stream", "frames", "time_us"} <= set(e)
        if e["action"] == "oom":
            assert isinstance(e["device_free"], int)  # was missing: KeyError in _memory_viz.trace


def test_a_split_range_renders_across_its_history():
    mid, end = split_history_snapshot()
    assert len(mid["segments"]) < sum(len(seg["blocks"]) for seg in mid["segments"])  # ranges inside segments
    assert check_renders(mid) > 15 and check_renders(end) > 20


@pytest.mark.skipif(SANITIZED_RUN, reason="torch is not loaded under the sanitizer run")
def test_memory_viz_trace_reads_oom_entries():
    from torch.cuda import _memory_viz

    a = vmalloc.Arena("host", capacity="4MiB", history=100)
    with pytest.raises(vmalloc.OutOfMemoryError):
        a.malloc(8 * MiB)
    text = _memory_viz.trace(a.snapshot())  # was: KeyError: 'device_free'
    assert "raise OutOfMemoryError # 8.0MiB requested, 4.0MiB free in CUDA" in text


def test_split_range_renders():
    chunk = 64 * KiB
    a = vmalloc.Arena("host", capacity=16 * chunk, chunk_size=chunk, small_max=16 * KiB, history=100, mid_chunks=0)
    a.free(a.malloc(6 * chunk))
    x = a.malloc(2 * chunk)  # split
    a.malloc(3 * chunk)  # split again
    a.free(x)
    assert check_renders(a.snapshot()) == 6  # frees elided: map, alloc, free, alloc, alloc, free


def test_one_segment_per_range_would_not_render():
    """The viewer check can fail: the old layout (a segment per range) breaks once a range is split."""
    chunk = 64 * KiB
    a = vmalloc.Arena("host", capacity=16 * chunk, chunk_size=chunk, small_max=16 * KiB, history=100)
    a.free(a.malloc(6 * chunk))
    a.malloc(2 * chunk)  # split: the 6-chunk segment_map now spans two ranges
    snap = a.snapshot()
    assert len(snap["segments"]) == 1 and check_renders(snap) == 4
    per_range = [
        {"device": 0, "address": addr, "total_size": size, "stream": stream,
         "blocks": [{"size": s, "state": state, "requested_size": r, "frames": []} for _, s, r, state in blocks]}
        for addr, size, stream, _small, blocks in a._segments()
    ]
    assert len(per_range) == 2
    with pytest.raises(ViewerError, match="not inside one segment"):
        check_renders({**snap, "segments": per_range})


def test_dump_snapshot_round_trips(tmp_path):
    a, snap = make_snapshot()
    path = vmalloc.dump_snapshot(tmp_path / "snap.pickle", a)
    with open(path, "rb") as f:
        assert pickle.load(f)["segments"] == snap["segments"]


@pytest.mark.skipif(SANITIZED_RUN, reason="torch is not loaded under the sanitizer run")
def test_torch_memory_viz_functions_run_on_it():
    from torch.cuda import _memory_viz

    for snap in (make_snapshot()[1], *split_history_snapshot()):
        assert "<html" in _memory_viz.segment_plot(snap).lower()
        assert "<html" in _memory_viz.trace_plot(snap).lower()
        assert "<html" in _memory_viz.trace_plot(snap, plot_segments=True).lower()
        text = _memory_viz.trace(snap)
        assert "raise OutOfMemoryError" in text or "oom" not in {e["action"] for e in snap["device_traces"][0]}
        assert "total_reserved" in _memory_viz.segsum(snap)
        lines = _memory_viz.segments(snap, format_flamegraph=lambda s: s)
        assert lines.count("\n") >= len(snap["segments"])
        _memory_viz.memory(snap, format_flamegraph=lambda s: s)
        _memory_viz.compare(snap["segments"], snap["segments"], format_flamegraph=lambda s: s)
        _memory_viz.filter_alloc_free_pairs(pickle.loads(pickle.dumps(snap)))
