"""The VMM cost table, its JSON loader, the simulator's charging of VMM work, and its attribution to steps."""

import json

import numpy as np
import pytest

from bench.vmm_costs import COSTS, MiB, for_device, load
from bench.vmm_work import step_work
from swap import Schedule, Sequence, make_schedule, simulate
from swap.capture import ALLOC, FREE, ITER_BEGIN, ITER_END, SAVE, USE, Trace

US = 1e-6


def test_published_figures_and_chunk_scaling():
    a100 = COSTS["ampere"]
    assert a100.map == pytest.approx(1.45 * US) and a100.unmap == pytest.approx(25.63 * US)
    for name in ("v100", "v100-16gb", "h100-sxm", "a100-80gb", "l4", "rtx4090", "hopper"):
        assert for_device(name).set_access > 0
    # Hopper is the H200 measurement: creating a chunk is flat in its size there (14-18 us from 2 to 64 MiB).
    hopper = for_device("h100-sxm")
    assert "measured" in hopper.name and hopper.create == pytest.approx(14.713 * US)
    assert for_device("h200", 20 * MiB).create == pytest.approx(14.2595 * US, rel=0.01)
    big = a100.for_chunk(20 * MiB)
    # Per handle, map/unmap cost the same whatever the chunk size (pytorch#96995); creating clears bytes.
    assert big.map == a100.map and big.create == pytest.approx(10 * a100.create)
    assert a100.seconds(maps=10, unmaps=4, creates=1, releases=2) == pytest.approx(
        10 * (a100.map + a100.set_access) + 4 * a100.unmap + a100.create + 2 * a100.release
    )
    assert a100.seconds_from_stats({"num_maps": 3, "num_unmaps": 2}) == a100.seconds(3, 2)
    with pytest.raises(ValueError, match="no VMM costs"):
        for_device("tpu-v5")
    with pytest.raises(ValueError, match="positive"):
        a100.for_chunk(0)


def test_load_reads_the_file_make_gpu_writes(tmp_path):
    calls = {"cuMemCreate": 100.0, "cuMemMap": 2.0, "cuMemSetAccess": 10.0, "cuMemUnmap": 20.0, "cuMemRelease": 30.0}
    results = {str(mib): {c: {"median_us": us * (1 if c != "cuMemMap" else mib // 2), "p90_us": us, "n": 9}
                          for c, us in calls.items()} for mib in (2, 8)}  # fmt: skip
    path = tmp_path / "vmm_latency.json"
    path.write_text(json.dumps({"environment": {"device": "GPU X"}, "results_us": results}))
    c = load(path)
    assert (c.create, c.map, c.set_access, c.unmap, c.release) == pytest.approx((100 * US, 2 * US, 10 * US, 20 * US,
                                                                                  30 * US))  # fmt: skip
    assert "GPU X" in c.name
    assert load(path, chunk_size=8 * MiB).map == pytest.approx(8 * US)  # the nearest measured chunk size
    assert load(path, chunk_size=4 * MiB).create == pytest.approx(100 * US)  # 2 MiB's as measured: never scaled
    assert c.for_chunk(7 * MiB).map == pytest.approx(8 * US)  # the whole table travels with the costs
    path.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a VMM latency file"):
        load(path)


def test_simulator_charges_vmm_on_the_compute_stream_and_splits_link_stalls():
    # Two variables of 1 GB saved in forward and used in backward, a link of 1 GB/s.
    seq = Sequence([0, 1, 1, 0], ["save", "save", "use", "use"], [10**9, 10**9], [0] * 4, [0.5, 0.5, 0.5, 0.5])
    sched = make_schedule(seq, int(1.5e9), None, "all")
    base = simulate(seq, sched, 1e9, 1e9)
    vmm = [0.1, 0.0, 0.2, 0.0]
    charged = simulate(seq, sched, 1e9, 1e9, vmm=vmm)
    assert charged.vmm_time == pytest.approx(0.3)
    assert charged.step_time >= base.step_time and charged.lower_bound >= 0.3
    assert 0 <= charged.link_stall <= charged.stall_time
    with pytest.raises(ValueError, match="one entry per step"):
        simulate(seq, sched, 1e9, 1e9, vmm=[0.0])
    # v0's copy out queues behind v1's: the wait for it at step 2 is link-bound for the time it queued (0.5 s),
    # the rest is its own transfer; fetching it back at step 3, where it is used, is a late fetch, not the link.
    seq2 = Sequence([0, 1, 1, 0], ["save", "save", "use", "use"], [5 * 10**8] * 2, [0] * 4, [0.01] * 4)
    hand = Schedule("all", 10**10, 0, [[], [1, 0], [], []], [[], [], [0], []], [[], [], [], [0]], [0] * 4, 10**9)
    sim = simulate(seq2, hand, 1e9, 1e9)
    assert sim.stall_time == pytest.approx(0.99 + 0.5) and sim.link_stall == pytest.approx(0.5)


def _trace(rows):
    a = np.array(rows, dtype=np.float64)
    z = np.zeros(len(rows))
    return Trace(a[:, 0].astype(np.uint8), a[:, 1].astype(np.int64), a[:, 2].astype(np.int64),
                 z.astype(np.uint8), z.astype(np.int64), z, z, {})  # fmt: skip


def test_step_work_attributes_the_allocators_calls_to_steps():
    # Step 0 allocates 3 chunks (one block of 3 created and mapped: one call each, Note [Blocks and slices]);
    # step 1 frees them and allocates 4: the allocator grows the cached range in place by one chunk (Note [Grow
    # in place]: 1 created, 1 mapped, nothing unmapped); step 2 reuses the cached 4-chunk range: no call.
    # Creation is counted in chunks (its cost grows with bytes), the other calls in calls.
    mb2 = 2 * MiB
    it = [(ITER_BEGIN, 0, 0), (SAVE, 99, 0), (ALLOC, 1, 3 * mb2), (USE, 99, 0), (FREE, 1, 0), (ALLOC, 2, 4 * mb2),
          (USE, 99, 0), (FREE, 2, 0), (ALLOC, 3, 4 * mb2), (FREE, 3, 0), (ITER_END, 0, 0)]  # fmt: skip
    w = step_work(_trace(it))
    assert (w.maps, w.unmaps) == ([1, 1, 0], [0, 0, 0]) and w.ok
    assert w.totals["num_maps"] == 2 and w.creates == [3, 1, 0]
    assert sum(w.seconds(COSTS["ampere"])) == pytest.approx(COSTS["ampere"].seconds(2, 0, 4))
    assert not step_work(_trace(it), capacity=3 * mb2).ok  # the 4-chunk tensor does not fit 3 chunks
