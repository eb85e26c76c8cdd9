"""The fragmentation test, on vmalloc and on a model of PyTorch's best-fit caching allocator.

Fill 512 MiB with tensors of mixed sizes, free every other one, then ask for all the free memory in one
allocation. vmalloc maps the free chunks, wherever they are, into one contiguous range; a best-fit
allocator that splits cudaMalloc'ed segments has the memory, but not in one piece.

    python examples/fragmentation_demo.py
"""

from __future__ import annotations

import vmalloc
from swap.planning.replay import NativeCachingModel
from swap.planning.replay.workloads import fragmentation_workload

MiB = 1024 * 1024
CAPACITY = 512 * MiB


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

    r = fragmentation_workload(arena, CAPACITY, seed=1, on_alloc=write)
    intact = all(bytes(arena.buffer(a, 64)) == patterns[a] for a, _ in r["kept"])
    arena.check_invariants()
    show("vmalloc (host backend, 2 MiB chunks)", r)
    print(f"  kept tensors' data intact    {intact}")

    show(
        "PyTorch native caching allocator (policy model)",
        fragmentation_workload(NativeCachingModel(CAPACITY), CAPACITY, seed=1),
    )


if __name__ == "__main__":
    main()
