"""The allocator's OOM handler: device copies of the executor's resident variables freed, least recently used
first, before an allocation fails.

Note [Evicting a prefetch]
A plan holds its budget in the allocator's bytes, but vmalloc's capacity also holds what no allocation counts:
the free space inside slabs of small blocks, which a large request cannot use. So at a capacity equal to the
budget an allocation can fail while the plan holds: on an H200, 6.26 MiB was free when a 2.25 MiB activation
(two 2 MiB chunks) was refused, fewer than two chunks of it whole. The handler then frees what the step does not
use: first variables resident and idle, then those whose copy back is still in flight (a prefetch). A prefetch
dropped is fetched again on demand at its use: slower, never wrong. Its copy is waited for on the compute stream
first, like any release (Note [Releases without host waits] in swap/runtime/activations/transfers.py).
"""

from __future__ import annotations

from typing import Any


def evict_lru(ex: Any, nbytes: int) -> bool:
    """Frees device copies of ``ex``'s (the executor's) resident variables not used at this step, least recently
    used first and prefetches last (Note [Evicting a prefetch]), copying those that have no host copy yet, until
    ``nbytes`` are freed. True if anything was evicted."""
    with ex.lock:
        if ex.closed:
            return False
        current = ex.step - 1
        victims = sorted(
            (v for v in ex.vars if v.dev is not None and v.last_access < current),
            key=lambda v: (v.h2d is not None, v.last_access),
        )
        freed = 0
        for v in victims:
            if freed >= nbytes:
                break
            ex.transfers.release(v)
            freed += v.size
            ex.counters.evictions += 1
        return freed > 0
