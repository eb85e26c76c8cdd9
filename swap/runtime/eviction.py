"""The allocator's OOM handler: device copies of the executor's resident variables freed, least recently used
first, before an allocation fails."""

from __future__ import annotations

from typing import Any


def evict_lru(ex: Any, nbytes: int) -> bool:
    """Frees device copies of ``ex``'s (the executor's) resident variables, least recently used first (copying
    those that have no host copy yet, synchronously), until ``nbytes`` are freed. True if anything was evicted."""
    with ex.lock:
        if ex.closed:
            return False
        current = ex.step - 1
        victims = sorted(
            (v for v in ex.vars if v.dev is not None and v.last_access < current and v.h2d is None),
            key=lambda v: v.last_access,
        )
        freed = 0
        for v in victims:
            if freed >= nbytes:
                break
            ex.transfers.release(v)
            freed += v.size
            ex.counters.evictions += 1
        return freed > 0
