"""Allocation workloads of the allocator tests (tests/vmalloc, tests/gpu): anything with malloc/free/stats (a
``vmalloc.Arena`` or a policy model) runs them. examples/fragmentation_demo.py carries its own copy of the
fragmentation workload, since examples import no bench module."""

from __future__ import annotations

import random
from typing import Any, Callable, Optional

from vmalloc import OutOfMemoryError

MiB = 1024 * 1024


def mixed_sizes(seed: int, low: int = 3 * MiB // 2, high: int = 24 * MiB) -> Callable[[], int]:
    """Sizes drawn uniformly from [low, high), rounded to 512 B: activation-like tensors of mixed shapes."""
    rng = random.Random(seed)
    return lambda: rng.randrange(low, high) // 512 * 512


def fragmentation_workload(
    arena: Any,
    capacity: int,
    seed: int = 0,
    on_alloc: Optional[Callable[[int, int], None]] = None,
) -> dict[str, Any]:
    """Fill ``capacity`` with mixed sizes, free every other allocation, then ask for all the free memory
    at once (rounded down to 2 MiB): the request a swap runtime makes after evicting scattered tensors.

    ``arena`` is anything with malloc/free/stats (a vmalloc.Arena or a policy model). ``on_alloc(addr,
    size)`` is called for every allocation kept. Returns what happened, with the arena's stats.
    """
    next_size = mixed_sizes(seed)
    live: list[tuple[int, int]] = []
    filled = 0
    while True:
        size = next_size()
        if filled + size > capacity:
            break
        try:
            addr = arena.malloc(size)
        except OutOfMemoryError:
            break
        live.append((addr, size))
        filled += size
        if on_alloc:
            on_alloc(addr, size)
    for addr, _ in live[::2]:
        arena.free(addr)
    kept = live[1::2]
    free_bytes = capacity - arena.stats()["allocated_bytes.all.current"]
    request = free_bytes // (2 * MiB) * (2 * MiB)
    result: dict[str, Any] = {"allocations": len(live), "kept": kept, "free_bytes": free_bytes, "request": request}
    try:
        result["big"] = arena.malloc(request)
        result["ok"] = True
    except OutOfMemoryError as e:
        result["ok"] = False
        result["error"] = str(e)
    result["stats"] = arena.stats()
    return result
