"""The growth slack is reported apart (Note [Slack reported apart] in csrc/allocator.cpp): stats() gives the
bytes held beyond the most ever in use as slack_bytes, so that reserved - slack is what the working set needed.
The pattern is a training step's shape: activations allocated in a forward pass (some temporaries freed
early), then freed in reverse while differently sized gradients come and go; the first iteration grows, the
next ones repeat it. On the host backend, and on the cuda backend against the emulated driver (a child
process, Note [cuda tests in a child process] in backends.py)."""

import random

import pytest
from backends import CHUNK_SIZES, driver

import vmalloc

KiB, MiB = 1024, 1024 * 1024
CHUNKS = CHUNK_SIZES


BACKENDS = pytest.mark.parametrize("backend", ["host", "cuda"])



def replay(backend, stream, iterations=10, **options):
    """Maps per iteration, the final stats and the arena of the step pattern, replayed ``iterations`` times.
    Without the step plan unless asked (Note [Step plan]: it would serve the repeated step itself)."""
    options.setdefault("step_plan", False)
    chunk = CHUNKS[backend]
    a = vmalloc.Arena(backend, capacity=256 * chunk, chunk_size=chunk, small_max=16 * KiB, mid_chunks=0, **options)
    rng = random.Random(0)
    sizes = [rng.randint(1, 12) for _ in range(12)]
    weights = a.malloc(4 * chunk, stream)
    maps = []
    for _ in range(iterations):
        before = a.stats()["num_maps"]
        live = []
        for j, k in enumerate(sizes):
            live.append(a.malloc(k * chunk, stream))
            if j % 3 == 2:
                a.free(live.pop(len(live) // 2))
        while live:
            grad = a.malloc(sizes[len(live) % len(sizes)] * chunk // 2 + chunk, stream)
            a.free(live.pop())
            a.free(grad)
        maps.append(a.stats()["num_maps"] - before)
    a.check_invariants()
    stats = a.stats()
    a.free(weights)
    return maps, stats, a


@BACKENDS
def test_slack_is_what_reserved_holds_beyond_the_peak_in_use(backend):
    with driver(backend) as stream:
        maps, s, _ = replay(backend, stream, growth_slack=0.125)
    assert maps[-3:] == [0, 0, 0], maps  # the slack bought a step that settles (Note [Reuse before growth])
    assert s["slack_bytes.all.peak"] > 0
    assert s["slack_bytes.all.current"] == s["slack_bytes.all.peak"]  # held, not given back
    # Every request is whole chunks: allocated bytes are the chunks in use, and reserved is their peak + slack.
    assert s["reserved_bytes.all.peak"] - s["slack_bytes.all.peak"] <= s["allocated_bytes.all.peak"]
    assert s["reserved_bytes.all.peak"] <= s["allocated_bytes.all.peak"] * (1 + 0.125)


@BACKENDS
def test_no_slack_without_growth_slack(backend):
    with driver(backend) as stream:
        maps, s, _ = replay(backend, stream)  # growth_slack=0 by default
    assert s["slack_bytes.all.peak"] == s["slack_bytes.all.current"] == 0
    assert s["reserved_bytes.all.peak"] == s["allocated_bytes.all.peak"]
    assert sum(maps[-3:]) > 0  # the price: reclaims, each a map and an unmap, every iteration


@BACKENDS
@pytest.mark.parametrize("options", [{"growth_slack": 0.125}, {}])
def test_slack_after_empty_cache_and_reset(backend, options):
    with driver(backend) as stream:
        _, s, a = replay(backend, stream, iterations=4, **options)
        a.empty_cache()
        after = a.stats()
        assert after["slack_bytes.all.current"] <= after["reserved_bytes.all.current"]
        assert after["slack_bytes.all.peak"] == s["slack_bytes.all.peak"]  # a peak lasts until reset_peak_stats
        a.reset_peak_stats()
        assert a.stats()["slack_bytes.all.peak"] == a.stats()["slack_bytes.all.current"]
