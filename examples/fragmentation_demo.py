"""The fragmentation test, on vmalloc and on a model of PyTorch's best-fit caching allocator.

Fill 512 MiB with tensors of mixed sizes, free every other one, then ask for all the free memory in one
allocation. vmalloc maps the free chunks, wherever they are, into one contiguous range; a best-fit
allocator that splits cudaMalloc'ed segments has the memory, but not in one piece.

    python examples/fragmentation_demo.py
"""

from __future__ import annotations

import random
from typing import Any, Callable, Optional

import vmalloc
from swap.forecast.replay import NativeCachingModel

MiB = 1024 * 1024
CAPACITY = 512 * MiB


def fragment(arena: Any, seed: int, on_alloc: Optional[Callable[[int, int], None]] = None) -> dict:
    """Allocate activation-like sizes (1.5 to 24 MiB, 512 B multiples) until CAPACITY is full, free every
    other allocation, then ask for all the free memory in one piece (rounded down to 2 MiB)."""
    rng = random.Random(seed)
    live, used = [], 0
    while True:
        size = rng.randrange(3 * MiB // 2, 24 * MiB) // 512 * 512
        if used + size > CAPACITY:
            break
        try:
            live.append((arena.malloc(size), size))
        except vmalloc.OutOfMemoryError:
            break
        used += size
        if on_alloc:
            on_alloc(*live[-1])
    for addr, _ in live[::2]:
        arena.free(addr)
    free = CAPACITY - arena.stats()["allocated_bytes.all.current"]
    r = {"allocations": len(live), "kept": live[1::2], "free_bytes": free, "request": free // (2 * MiB) * (2 * MiB)}
    try:
        arena.malloc(r["request"])
        r["ok"] = True
    except vmalloc.OutOfMemoryError:
        r["ok"] = False
    r["stats"] = arena.stats()
    return r


def show(name: str, r: dict) -> None:
    s = r["stats"]
    verdict = "succeeded" if r["ok"] else "FAILED (out of memory)"
    print(f"\n{name}")
    print(f"  allocations made             {r['allocations']}, then every other freed")
    print(f"  free memory                  {r['free_bytes'] / MiB:8.1f} MiB")
    print(f"  one allocation of            {r['request'] / MiB:8.1f} MiB  -> {verdict}")
    print(f"  reserved / capacity          {s['reserved_bytes.all.current'] / MiB:8.1f} / {CAPACITY / MiB:.0f} MiB")
    for key in ("num_maps", "num_unmaps", "num_reclaims", "num_alloc_retries"):
        if key in s:
            print(f"  {key:<28} {s[key]}")


def main() -> None:
    # vmalloc on real host memory: every kept tensor holds a pattern that must survive the reclaim.
    arena = vmalloc.Arena("host", capacity=CAPACITY, chunk_size="2MiB")
    patterns = {}

    def write(addr: int, size: int) -> None:
        patterns[addr] = bytes([addr // MiB % 251]) * 64
        arena.buffer(addr, size)[:64] = patterns[addr]

    r = fragment(arena, seed=1, on_alloc=write)
    intact = all(bytes(arena.buffer(a, 64)) == patterns[a] for a, _ in r["kept"])
    arena.check_invariants()
    show("vmalloc (host backend, 2 MiB chunks)", r)
    print(f"  kept tensors' data intact    {intact}")

    show(
        "PyTorch native caching allocator (policy model)",
        fragment(NativeCachingModel(CAPACITY), seed=1),
    )


if __name__ == "__main__":
    main()
