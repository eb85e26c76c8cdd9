"""Replays an allocation trace against an allocator and measures it the way the field does.

Allocators (``make_allocator``): ``vmalloc`` (the real allocator core on its sim backend: any scale;
``vmalloc-host``: real memory, a cross-check), with ``chunk_size``; ``pytorch_native`` and
``pytorch_expandable`` (``swap.forecast.replay.torch_policy``).

Metrics (anchors-allocators.md (d)):
- peak requested / allocated / reserved bytes;
- GMLake utilization = peak active / peak reserved, fragmentation = 1 - utilization;
- STAlloc steady state: per iteration (peaks reset at its start) allocated / reserved, averaged over the
  iterations after the first;
- internal waste = peak allocated - peak requested;
- maps / unmaps / reclaims (vmalloc), segments (cudaMalloc calls) for PyTorch's policies;
- replay time per operation (of the allocator model in Python: comparable between runs, not a GPU figure).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import vmalloc

from ...capture.trace import ALLOC, FREE, ITER_BEGIN, ITER_END, Trace
from ...schedule.scheduler import InfeasibleBudget, Schedule
from ..from_trace import swapped
from .torch_policy import ExpandableSegmentsModel, NativeCachingModel

ALLOCATORS = ("vmalloc", "pytorch_native", "pytorch_expandable")
CHUNK_SIZE = 2 << 20  # bytes: vmalloc's chunk in the replays (its default): an arena holds whole chunks


def make_allocator(name: str, capacity: int, chunk_size: str | int = CHUNK_SIZE) -> Any:
    if name == "vmalloc":
        return vmalloc.Arena("sim", capacity=capacity, chunk_size=chunk_size)
    if name == "vmalloc-host":
        return vmalloc.Arena("host", capacity=capacity, chunk_size=chunk_size)
    if name == "pytorch_native":
        return NativeCachingModel(capacity)
    if name == "pytorch_expandable":
        return ExpandableSegmentsModel(capacity)
    raise ValueError(f"unknown allocator {name!r}: choose vmalloc, vmalloc-host, pytorch_native, pytorch_expandable")


def replay(trace: Trace, allocator: Any, series_every: int = 0) -> dict[str, Any]:
    """Runs the trace; stops at the first out-of-memory (``ok`` False, ``oom_at`` the event index).

    ``series_every`` > 0 samples (event, requested, reserved) every that many events, for plots."""
    ops, ids, sizes, streams = trace.op.tolist(), trace.id.tolist(), trace.size.tolist(), trace.stream.tolist()
    addr: dict[int, int] = {}
    per_iter: list[tuple[int, int]] = []
    series: list[tuple[int, int, int]] = []
    ok, oom_at, n_ops, t_ops = True, None, 0, 0.0
    malloc, free = allocator.malloc, allocator.free
    for k, (o, i, s, st) in enumerate(zip(ops, ids, sizes, streams)):
        if o == ALLOC:
            t0 = time.perf_counter()
            try:
                addr[i] = malloc(s, st)
            except vmalloc.OutOfMemoryError:
                ok, oom_at = False, k
                break
            t_ops += time.perf_counter() - t0
            n_ops += 1
        elif o == FREE:
            a = addr.pop(i, None)
            if a is not None:
                t0 = time.perf_counter()
                free(a)
                t_ops += time.perf_counter() - t0
                n_ops += 1
        elif o == ITER_BEGIN:
            allocator.reset_peak_stats()
        elif o == ITER_END:
            s_ = allocator.stats()
            per_iter.append((s_["allocated_bytes.all.peak"], s_["reserved_bytes.all.peak"]))
        if series_every and k % series_every == 0:
            s_ = allocator.stats()
            series.append((k, s_["requested_bytes.all.current"], s_["reserved_bytes.all.current"]))
    return {"ok": ok, "oom_at": oom_at, "per_iteration": per_iter, "series": series,
            "ops": n_ops, "seconds": t_ops}  # fmt: skip


def measure(trace: Trace, allocator_name: str, capacity: Optional[int] = None, chunk_size: str | int = CHUNK_SIZE,
            series_every: int = 0) -> dict[str, Any]:  # fmt: skip
    """Replays ``trace`` on a fresh allocator and returns the metrics (capacity None: unlimited, 4 TiB)."""
    cap = capacity or (4 << 40)
    alloc = make_allocator(allocator_name, cap, chunk_size)
    # Peaks over the whole trace: replay() resets them per iteration, so track the maxima here.
    r = replay(trace, alloc, series_every)
    s = alloc.stats()
    iters = r["per_iteration"]
    peak_alloc = max([a for a, _ in iters] + [s["allocated_bytes.all.peak"]])
    peak_res = max([b for _, b in iters] + [s["reserved_bytes.all.peak"]])
    steady = iters[1:] or iters
    out = {
        "allocator": allocator_name,
        "chunk_size": vmalloc.parse_size(chunk_size) if allocator_name.startswith("vmalloc") else None,
        "capacity": capacity,
        "ok": r["ok"],
        "oom_at": r["oom_at"],
        "peak_allocated": peak_alloc,
        "peak_reserved": peak_res,
        "utilization": peak_alloc / peak_res if peak_res else 1.0,
        "steady_utilization": sum(a / b for a, b in steady) / len(steady) if steady else None,
        "steady_wasted_bytes": sum(b - a for a, b in steady) / len(steady) if steady else None,
        "num_maps": s.get("num_maps", s.get("num_device_alloc", 0)),
        "num_unmaps": s.get("num_unmaps", s.get("num_device_free", 0)),
        "num_reclaims": s.get("num_reclaims", 0),
        "num_alloc_retries": s.get("num_alloc_retries", 0),
        "us_per_op": 1e6 * r["seconds"] / max(1, r["ops"]),
        "series": r["series"],
    }
    out["fragmentation"] = 1 - out["utilization"]
    return out


# Note [Plan budget under an allocator]
# With swapping, the plan's budget must leave room for what the allocator holds beyond live tensors (its
# rounding, its cache). A user (or a runtime reading the allocator) lowers the budget until the run fits; how
# far it must go is the price of the allocator's fragmentation. The first steps are fine-grained: an allocator
# that wastes little (vmalloc: under one chunk per live tensor) needs only a little less than the device.
BUDGET_FRACTIONS = (1.0, 0.998, 0.995, 0.99, 0.985, 0.98, 0.97, 0.96, 0.94, 0.92, 0.9, 0.85, 0.8, 0.7, 0.6)


def fitting_budget(
    trace: Trace,
    allocator: str,
    capacity: int,
    schedule_for: Optional[Callable[[int], Schedule]] = None,
    min_bytes: int = 0,
) -> Optional[int]:
    """The largest plan budget (capacity x BUDGET_FRACTIONS) whose swapped trace replays within capacity on
    ``allocator``. ``schedule_for(budget)`` plans ``sequence_from_trace(trace, min_bytes=min_bytes)`` (default:
    the window policy, window chosen on a 50 GB/s link)."""
    for f in BUDGET_FRACTIONS:
        budget = int(capacity * f)
        try:
            schedule = schedule_for(budget) if schedule_for is not None else None
            st = swapped(trace, budget, schedule=schedule, min_bytes=min_bytes)
        except InfeasibleBudget:
            return None  # lower budgets are infeasible too
        if measure(st, allocator, capacity=capacity)["ok"]:
            return budget
    return None
