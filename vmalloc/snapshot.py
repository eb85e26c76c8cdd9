"""Snapshots in PyTorch's memory-snapshot layout, so https://pytorch.org/memory_viz opens them.

Each mapped range is one segment (``is_expandable``: its chunks were mapped, not cudaMalloc'ed); slabs are
``small`` segments holding 512 B-granular blocks. ``device_traces`` holds the arena's history (enable it
with ``Arena(history=N)``, ``arena.set_history(N)`` or ``VMALLOC_CONF=history=N``).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Union


def snapshot_dict(arena: Any) -> dict[str, Any]:
    """Builds the snapshot dict of a ``vmalloc.Arena`` (or ``_C.Arena``)."""
    device = arena.device
    segments = []
    for addr, size, stream, small, blocks in arena._segments():
        block_dicts = [
            {
                "address": a,
                "size": s,
                "requested_size": r,
                "state": "active_allocated" if allocated else "inactive",
                "frames": [],
            }
            for a, s, r, allocated in blocks
        ]
        allocated_size = sum(b["size"] for b in block_dicts if b["state"] == "active_allocated")
        segments.append(
            {
                "device": device,
                "address": addr,
                "total_size": size,
                "allocated_size": allocated_size,
                "active_size": allocated_size,
                "requested_size": sum(b["requested_size"] for b in block_dicts),
                "stream": stream,
                "segment_type": "small" if small else "large",
                "segment_pool_id": (0, 0),
                "is_expandable": True,
                "frames": [],
                "blocks": block_dicts,
            }
        )
    traces: list[list[dict[str, Any]]] = [[] for _ in range(device + 1)]
    traces[device] = [
        {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": t, "frames": []}
        for action, addr, size, stream, t in arena._trace()
    ]
    return {"segments": segments, "device_traces": traces, "allocator_settings": dict(arena.config)}


def dump_snapshot(path: Union[str, Path], snapshot: Any) -> Path:
    """Writes ``snapshot`` (a dict from ``snapshot()``, or an arena) as the pickle the memory viewer opens."""
    if not isinstance(snapshot, dict):
        snapshot = snapshot_dict(snapshot)
    path = Path(path)
    with path.open("wb") as f:
        pickle.dump(snapshot, f)
    return path
