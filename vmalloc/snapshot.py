"""Snapshots in PyTorch's memory-snapshot layout, so https://pytorch.org/memory_viz and
``torch.cuda._memory_viz`` open them.

``device_traces`` holds the arena's history (enable it with ``Arena(history=N)``, ``arena.set_history(N)``
or ``VMALLOC_CONF=history=N``).

Note [Snapshot segments]
The allocator's unit is a range (a large allocation, a cached free range, a slab), and ranges are split
(a cached range serves a smaller request and keeps the rest) and merged (neighbouring free ranges of a
stream) without any mapping call. PyTorch's viewer reconstructs the past by replaying the trace backwards
from the snapshot's segments, with the rules of expandable segments: a ``segment_map`` must lie inside one
segment, a ``segment_unmap`` re-creates memory that merges with a neighbour of the same stream, and every
block lies inside a segment. If each range were a segment, the ``segment_map`` of a range that has since
been split would cover two segments, which the viewer cannot render. So a segment here is what the trace
speaks of: a maximal run of contiguous mapped chunks of one stream (``is_expandable``: its chunks were
mapped, not cudaMalloc'ed), and each range is a block inside it (slabs: their 512 B-granular blocks).
``segment_type`` is ``small`` for a run made only of slabs. A split or merge thus changes blocks, never
segments, and only ``segment_map``/``segment_unmap`` (real mapping calls) change segments.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Union


def _segments(arena: Any) -> list[dict[str, Any]]:
    device = arena.device
    runs: list[dict[str, Any]] = []
    for addr, size, stream, small, blocks in arena._segments():
        block_dicts = [
            {"address": a, "size": s, "requested_size": r, "state": state, "frames": []} for a, s, r, state in blocks
        ]
        last = runs[-1] if runs else None
        if last is not None and last["address"] + last["total_size"] == addr and last["stream"] == stream:
            last["total_size"] += size
            last["blocks"].extend(block_dicts)
            last["_small"] = last["_small"] and small
            continue
        runs.append(
            {
                "device": device,
                "address": addr,
                "total_size": size,
                "stream": stream,
                "segment_pool_id": (0, 0),
                "is_expandable": True,
                "frames": [],
                "blocks": block_dicts,
                "_small": small,
            }
        )
    for seg in runs:
        blocks = seg["blocks"]
        seg["segment_type"] = "small" if seg.pop("_small") else "large"
        seg["allocated_size"] = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        seg["active_size"] = sum(b["size"] for b in blocks if b["state"].startswith("active"))
        seg["requested_size"] = sum(b["requested_size"] for b in blocks)
    return runs


def _trace_entry(action: str, addr: int, size: int, stream: int, time_us: int, device_free: int) -> dict[str, Any]:
    entry = {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": time_us, "frames": []}
    if action == "oom":
        # What PyTorch reports as the device's free memory; for vmalloc, the capacity not yet reserved.
        entry["device_free"] = device_free
    return entry


def snapshot_dict(arena: Any) -> dict[str, Any]:
    """Builds the snapshot dict of a ``vmalloc.Arena`` (or ``_C.Arena``)."""
    device = arena.device
    traces: list[list[dict[str, Any]]] = [[] for _ in range(device + 1)]
    traces[device] = [_trace_entry(*e) for e in arena._trace()]
    return {"segments": _segments(arena), "device_traces": traces, "allocator_settings": dict(arena.config)}


def dump_snapshot(path: Union[str, Path], snapshot: Any) -> Path:
    """Writes ``snapshot`` (a dict from ``snapshot()``, or an arena) as the pickle the memory viewer opens."""
    if not isinstance(snapshot, dict):
        snapshot = snapshot_dict(snapshot)
    path = Path(path)
    with path.open("wb") as f:
        pickle.dump(snapshot, f)
    return path
