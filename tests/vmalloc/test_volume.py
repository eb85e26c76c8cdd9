"""Volume: a million random allocator operations per run, every invariant checked after every one.

The sim backend gives the volume (bookkeeping only: addresses, chunks, mappings, no bytes, so an operation
costs microseconds); the host backend gives the bytes (every allocation is written, checked when it is
freed, and every live one re-checked every few operations, across reclaims that remap its chunks). After
each operation: the arena's own recount (``check_invariants``: every statistic, every range, slab, mapping
and cache entry), and against the workload's books (arena_workload.Workload, ``strict``): no new allocation
overlaps a live one, an OOM only when the capacity cannot hold the request beside the live data, the live
count and requested bytes equal the books. The counts go into the run's summary (run_summary.py).
"""

import pytest
from arena_workload import Workload
from backends import HostMemory, SimMemory
from run_summary import SUMMARY

from tests_support import SANITIZED_RUN

MiB = 1 << 20

# Under ASan + UBSan (make test-sanitize) a tenth: the sanitizers look at the same code paths, slower.
SCALE = 10 if SANITIZED_RUN else 1

# name -> (arena options, largest request in chunks, operations)
SIM_CASES = {
    "cache_first": ({}, 6, 300_000),
    "eager_growth": ({"eager_growth": True}, 6, 300_000),
    "one_chunk_blocks": ({"block_size": 2 * MiB}, 6, 300_000),  # every chunk its own backend allocation
    # Longer ranges and more live state: each check recounts ~5x more, so fewer operations.
    "many_chunks": ({"capacity": 512 * 2 * MiB, "small_max": 1 * MiB}, 40, 100_000),
}
HOST_CASES = {
    "cache_first": ({}, 6, 20_000),
    "eager_growth": ({"eager_growth": True}, 6, 20_000),
    "one_chunk_blocks": ({"block_size": 64 * 1024}, 6, 20_000),
    "long_ranges": ({"capacity": 128 * 64 * 1024}, 24, 20_000),
}


def run_checked(memory, options: dict, max_large: int, ops: int, seed: int, verify_every: int = 1) -> None:
    arena = memory.arena(**options)
    w = Workload(arena, memory, seed=seed, max_large=max_large, strict=True, verify_every=verify_every)
    tally = w.run(ops)
    mallocs = arena.stats()["num_alloc"]
    w.drain()
    assert tally.ops == ops and tally.errors == 0
    assert mallocs > ops // 4, "the workload should allocate in about half of its steps"
    assert arena.stats()["reserved_bytes.all.current"] == 0  # everything went back
    SUMMARY.count_ops(memory.name, ops)


@pytest.mark.parametrize("case", sorted(SIM_CASES))
def test_a_million_checked_operations_on_the_sim_backend(case):
    options, max_large, ops = SIM_CASES[case]
    run_checked(SimMemory(), options, max_large, ops // SCALE, seed=sorted(SIM_CASES).index(case))


@pytest.mark.parametrize("case", sorted(HOST_CASES))
def test_checked_operations_keep_every_byte_on_the_host_backend(case):
    options, max_large, ops = HOST_CASES[case]
    run_checked(HostMemory(), options, max_large, ops // SCALE, seed=100 + sorted(HOST_CASES).index(case),
                verify_every=8)  # fmt: skip
