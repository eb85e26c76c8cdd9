"""The growth slack is reported apart (Note [Slack reported apart] in csrc/allocator.cpp): stats() gives the
bytes held beyond the most ever in use as slack_bytes, so that reserved - slack is what the working set needed.
The pattern is a training step's shape on the host backend: activations allocated in a forward pass (some
temporaries freed early), then freed in reverse while differently sized gradients come and go; the first
iteration grows, the next ones repeat it."""

import random

import pytest

import vmalloc

KiB = 1024
CHUNK = 64 * KiB


def replay(iterations=10, **options):
    """Maps per iteration and the final stats of the step pattern, replayed ``iterations`` times."""
    a = vmalloc.Arena("host", capacity=256 * CHUNK, chunk_size=CHUNK, small_max=16 * KiB, mid_chunks=0, **options)
    rng = random.Random(0)
    sizes = [rng.randint(1, 12) for _ in range(40)]
    weights = a.malloc(4 * CHUNK, 0)
    maps = []
    for _ in range(iterations):
        before = a.stats()["num_maps"]
        live = []
        for j, k in enumerate(sizes):
            live.append(a.malloc(k * CHUNK, 0))
            if j % 3 == 2:
                a.free(live.pop(len(live) // 2))
        while live:
            grad = a.malloc(sizes[len(live) % len(sizes)] * CHUNK // 2 + CHUNK, 0)
            a.free(live.pop())
            a.free(grad)
        maps.append(a.stats()["num_maps"] - before)
    a.check_invariants()
    stats = a.stats()
    a.free(weights)
    return maps, stats, a


def test_slack_is_what_reserved_holds_beyond_the_peak_in_use():
    maps, s, _ = replay()
    assert maps[-3:] == [0, 0, 0], maps  # the slack bought a step that settles (Note [Reuse before growth])
    assert s["slack_bytes.all.peak"] > 0
    assert s["slack_bytes.all.current"] == s["slack_bytes.all.peak"]  # held, not given back
    # Every request is whole chunks: allocated bytes are the chunks in use, and reserved is their peak + slack.
    assert s["reserved_bytes.all.peak"] - s["slack_bytes.all.peak"] <= s["allocated_bytes.all.peak"]
    assert s["reserved_bytes.all.peak"] <= s["allocated_bytes.all.peak"] * (1 + 0.125)


def test_no_slack_without_growth_slack():
    maps, s, _ = replay(growth_slack=0)
    assert s["slack_bytes.all.peak"] == s["slack_bytes.all.current"] == 0
    assert s["reserved_bytes.all.peak"] == s["allocated_bytes.all.peak"]
    assert sum(maps[-3:]) > 0  # the price: reclaims, each a map and an unmap, every iteration


@pytest.mark.parametrize("options", [{}, {"growth_slack": 0}])
def test_slack_after_empty_cache_and_reset(options):
    _, s, a = replay(iterations=4, **options)
    a.empty_cache()
    after = a.stats()
    assert after["slack_bytes.all.current"] <= after["reserved_bytes.all.current"]
    assert after["slack_bytes.all.peak"] == s["slack_bytes.all.peak"]  # a peak lasts until reset_peak_stats
    a.reset_peak_stats()
    assert a.stats()["slack_bytes.all.peak"] == a.stats()["slack_bytes.all.current"]
