"""The allocator invariants on the cuda backend: real cuMemCreate/cuMemMap, data checked on the device."""

import random

import pytest
import torch

import vmalloc

from cuda_view import bytes_at

MiB = 1024 * 1024


def test_granularity_and_bad_chunk_size():
    a = vmalloc.Arena("cuda", capacity="64MiB")
    assert a.granularity % (2 * MiB) == 0 or (2 * MiB) % a.granularity == 0
    with pytest.raises(ValueError, match="granularity"):
        vmalloc.Arena("cuda", chunk_size=a.granularity + 4096)


def test_random_sequence_keeps_data_across_reclaims():
    arena = vmalloc.Arena("cuda", capacity="256MiB", chunk_size="2MiB")
    rng = random.Random(0)
    live = {}
    streams = [torch.cuda.Stream() for _ in range(2)]
    for step in range(1500):
        if live and (rng.random() < 0.45 or len(live) > 40):
            addr = rng.choice(sorted(live))
            size, tag = live.pop(addr)
            assert bool((bytes_at(addr, size) == tag).all()), f"allocation {addr:#x} changed"
            arena.free(addr)
        else:
            size = rng.choice([rng.randint(1, 1 * MiB), rng.randint(1 * MiB, 40 * MiB)])
            s = rng.choice(streams)
            try:
                addr = arena.malloc(size, stream=s.cuda_stream)
            except vmalloc.OutOfMemoryError:
                continue
            tag = step % 251
            with torch.cuda.stream(s):
                bytes_at(addr, size).fill_(tag)
            s.synchronize()
            live[addr] = (size, tag)
        if step % 100 == 0:
            arena.check_invariants()
            assert arena.stats()["reserved_bytes.all.current"] <= 256 * MiB
    torch.cuda.synchronize()
    for addr, (size, tag) in live.items():
        assert bool((bytes_at(addr, size) == tag).all())
        arena.free(addr)
    s = arena.stats()
    assert s["num_reclaims"] > 0, "the sequence should have exercised reclaim"
    arena.empty_cache()
    assert arena.stats()["reserved_bytes.all.current"] == 0
    arena.check_invariants()


def test_fragmentation_workload_on_the_device():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.workloads import fragmentation_workload

    cap = 512 * MiB
    r = fragmentation_workload(vmalloc.Arena("cuda", capacity=cap), cap, seed=1)
    assert r["ok"], r.get("error")
    bytes_at(r["big"], r["request"]).fill_(3)
    torch.cuda.synchronize()
