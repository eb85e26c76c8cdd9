"""Snapshots use PyTorch's layout: torch's own memory-viz code renders them."""

import pickle

import pytest

import vmalloc

from tests_support import SANITIZED_RUN

MiB = 1024 * 1024


def make_snapshot():
    a = vmalloc.Arena("host", capacity="32MiB", history=1000)
    ps = [a.malloc(n) for n in (100, 4000, 3 * MiB, 5 * MiB)]
    a.free(ps[1])
    a.free(ps[2])
    a.malloc(24 * MiB - 1)  # every free chunk: forces a reclaim: segment_unmap + segment_map
    return a, a.snapshot()


def test_snapshot_layout():
    a, snap = make_snapshot()
    assert set(snap) >= {"segments", "device_traces", "allocator_settings"}
    seg_types = {s["segment_type"] for s in snap["segments"]}
    assert seg_types == {"small", "large"}
    for seg in snap["segments"]:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
    actions = [e["action"] for e in snap["device_traces"][0]]
    assert {"alloc", "free_requested", "free_completed", "segment_map", "segment_unmap"} <= set(actions)
    assert a.stats()["allocated_bytes.all.current"] == sum(s["allocated_size"] for s in snap["segments"])


def test_dump_snapshot_round_trips(tmp_path):
    a, snap = make_snapshot()
    path = vmalloc.dump_snapshot(tmp_path / "snap.pickle", a)
    with open(path, "rb") as f:
        assert pickle.load(f)["segments"] == snap["segments"]


@pytest.mark.skipif(SANITIZED_RUN, reason="torch is not loaded under the sanitizer run")
def test_torch_memory_viz_renders_it():
    from torch.cuda import _memory_viz

    _, snap = make_snapshot()
    assert "<html" in _memory_viz.segment_plot(snap).lower()
    assert "<html" in _memory_viz.trace_plot(snap).lower()
