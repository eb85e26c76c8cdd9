"""The data logic of PyTorch's memory viewer (torch/utils/viz/MemoryViz.js, which torch.cuda._memory_viz's
segment_plot and trace_plot embed), ported to Python so tests can check that a snapshot renders: the
"Allocator State History" view replays the trace backwards from the snapshot's segments and blocks, and
breaks (a JavaScript TypeError in the browser) when a segment_map is not inside one segment or a block is
outside every segment. Ported from annotate_snapshot and MemoryView.simulate_memory (PyTorch 2.x)."""

from __future__ import annotations

import copy
from typing import Any


class ViewerError(AssertionError):
    pass


def annotate(snapshot: dict[str, Any], device: int) -> tuple[list[dict], list[dict], dict[int, dict]]:
    """What annotate_snapshot leaves: the device's events (free_requested + free_completed of one address
    elided into 'free'), its segments and the blocks the viewer tracks (active ones), by address."""
    events: list[dict] = []
    for e in copy.deepcopy(snapshot["device_traces"][device]):
        if e["action"] == "free_completed" and events:
            prev = events[-1]
            if prev["action"] == "free_requested" and prev["addr"] == e["addr"]:
                prev["action"] = "free"
                continue
        events.append(e)
    segments, blocks = [], {}
    for seg in snapshot["segments"]:
        if seg["device"] != device:
            continue
        segments.append({"addr": seg["address"], "size": seg["total_size"], "stream": seg["stream"]})
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] in ("active_allocated", "active_pending_free"):
                blocks[addr] = {"addr": addr, "size": b["size"], "free_requested": b["state"] == "active_pending_free"}
            addr += b["size"]
        if addr != seg["address"] + seg["total_size"]:
            raise ViewerError(f"blocks of segment {seg['address']:#x} do not add up to its size")
    segments.sort(key=lambda s: s["addr"])
    return events, segments, blocks


def simulate(snapshot: dict[str, Any], device: int, idx: int) -> tuple[list[dict], list[dict]]:
    """simulate_memory(idx): the segments and blocks the viewer draws after event idx (-1: before all)."""
    events, sorted_segments, block_map = annotate(snapshot, device)
    segs = [dict(s) for s in sorted_segments]
    blocks = dict(block_map)

    def map_segment(seg: dict) -> None:  # merge mode (segment_unmap replayed backwards)
        i = next((k for k, e in enumerate(segs) if e["addr"] > seg["addr"]), len(segs))
        segs.insert(i, seg)
        if i + 1 < len(segs):
            nxt = segs[i + 1]
            if seg["addr"] + seg["size"] == nxt["addr"] and seg["stream"] == nxt["stream"]:
                seg["size"] += nxt["size"]
                del segs[i + 1]
        if i > 0:
            prev = segs[i - 1]
            if prev["addr"] + prev["size"] == seg["addr"] and prev["stream"] == seg["stream"]:
                prev["size"] += seg["size"]
                del segs[i]

    def unmap_segment(seg: dict) -> None:  # merge mode (segment_map replayed backwards)
        end = seg["addr"] + seg["size"]
        i = next((k for k, e in enumerate(segs) if e["addr"] <= seg["addr"] and end <= e["addr"] + e["size"]), -1)
        if i < 0:
            raise ViewerError(f"segment_map of [{seg['addr']:#x}, {end:#x}) is not inside one segment")
        existing = segs[i]
        existing_end = existing["addr"] + existing["size"]
        if existing["addr"] == seg["addr"]:
            existing["addr"] += seg["size"]
            existing["size"] -= seg["size"]
            if existing["size"] == 0:
                del segs[i]
        elif existing_end == end:
            existing["size"] -= seg["size"]
        else:
            existing["size"] = seg["addr"] - existing["addr"]
            segs.insert(i + 1, {"addr": end, "size": existing_end - end, "stream": existing["stream"]})

    for e in reversed(events[idx + 1:]):
        action = e["action"]
        if action in ("free", "free_completed"):
            blocks[e["addr"]] = {"addr": e["addr"], "size": e["size"], "free_requested": action == "free_completed"}
        elif action == "free_requested":
            if e["addr"] not in blocks:
                raise ViewerError(f"free_requested of {e['addr']:#x}, a block the viewer does not know")
            blocks[e["addr"]]["free_requested"] = False
        elif action == "alloc":
            blocks.pop(e["addr"], None)
        elif action in ("segment_unmap", "segment_free"):
            map_segment({"addr": e["addr"], "size": e["size"], "stream": e["stream"]})
        elif action in ("segment_map", "segment_alloc"):
            unmap_segment({"addr": e["addr"], "size": e["size"], "stream": e["stream"]})
    return segs, list(blocks.values())


def check_renders(snapshot: dict[str, Any], device: int = 0) -> int:
    """Simulates the view at every event as the viewer would; raises ViewerError where it would break.
    Returns the number of events checked."""
    events = annotate(snapshot, device)[0]
    for idx in range(-1, len(events)):
        segs, blocks = simulate(snapshot, device, idx)
        for a, b in zip(segs, segs[1:]):
            if a["addr"] + a["size"] > b["addr"]:
                raise ViewerError(f"after event {idx}: segments overlap at {b['addr']:#x}")
        for blk in blocks:
            if not any(s["addr"] <= blk["addr"] < s["addr"] + s["size"] for s in segs):
                raise ViewerError(f"after event {idx}: block {blk['addr']:#x} is outside every segment")
    return len(events)
