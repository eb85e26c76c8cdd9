"""Model-state offload on one FSDP2 rank, forecast (Note [Model-state offload on one rank]): the rank's trace holds
no model state, each offloaded unit's shard is copied in before its all-gathers, and the host steps, priced on the
host profile shared by the ranks of one host, hide behind the forward or bind the step."""

import dataclasses
import functools

import pytest

from bench import fsdp_cpu
from swap.capture import capture
from swap.capture.trace import ALLOC, TAG, live_peak
from swap.devices import HOST_PROFILES, profile
from swap.forecast.distributed import Offload, fsdp2, rank_step, rank_trace, sharding
from swap.forecast.fsdp2_lanes import UnitSeconds, keep_resident, simulate_rank

LAYERS, D, BATCH = 3, 128, 6
MODEL = functools.partial(fsdp_cpu.model_fn, LAYERS, D)


@pytest.fixture(scope="module")
def trace():
    return capture(MODEL, fsdp_cpu.batch_fn, BATCH, fsdp_cpu.loss_fn, steps=2, target="cpu")


def _allocs(t, tag: str) -> int:
    return int(((t.op == ALLOC) & (t.tag == TAG[tag])).sum())


def test_an_offloading_rank_holds_no_model_state_and_copies_each_offloaded_shard_in(trace):
    plain, offloaded = fsdp2(MODEL, 2), fsdp2(MODEL, 2, offload=Offload())
    held, off = rank_trace(trace, plain), rank_trace(trace, offloaded)
    assert _allocs(held, "weight") > 0 and _allocs(held, "optimizer_state") > 0
    assert _allocs(off, "weight") == 0 and _allocs(off, "optimizer_state") == 0
    assert live_peak(off) < live_peak(held)
    # Every offloaded unit's shard comes in before each of its all-gathers (the root once, each block twice); a
    # resident unit's is not copied in (its model state is taken off the budget by the caller).
    units = frozenset(u.path for u in offloaded.units)
    resident = rank_trace(trace, fsdp2(MODEL, 2, offload=Offload(resident=units)))
    copies = _allocs(off, "temporary") - _allocs(resident, "temporary")
    assert copies == len(trace.iterations()) * (1 + 2 * LAYERS)
    kept = fsdp2(MODEL, 2, offload=Offload(resident=frozenset({"", "blocks.0"})))
    assert _allocs(off, "temporary") - _allocs(rank_trace(trace, kept), "temporary") == len(trace.iterations()) * 3


def _seconds(host: float) -> UnitSeconds:
    blocks = ("b0", "b1", "b2")
    compute = {**{(u, "f"): 1.0 for u in blocks}, **{(u, "b"): 2.0 for u in blocks}}
    off = {u: 0.01 for u in ("", *blocks)}
    return UnitSeconds(blocks, blocks[::-1], compute, dict.fromkeys(("", *blocks), 0.001), h2d=off, d2h=off,
                       host=dict.fromkeys(("", *blocks), host))  # fmt: skip


def test_host_steps_hide_behind_the_forward_on_a_fast_host_and_bind_on_a_slow_one():
    fast = simulate_rank(_seconds(0.2))
    assert fast.compute_time == 9.0 and fast.exposed < 0.5 and fast.bound == "compute"
    # Each unit's forward waits for its own host step, queued in forward order after the last gradient copy.
    slow = simulate_rank(_seconds(3.0))
    assert slow.bound == "host step" and slow.terms["host step"] == 12.0
    assert slow.step_time > 12.0 + 6.0  # the host is idle during the backward: update-before-use
    assert simulate_rank(_seconds(3.0), iterations=1).step_time < slow.step_time  # the steady state is slower


def test_the_hosts_dram_bounds_the_step():
    s = dataclasses.replace(_seconds(0.2), dram_seconds=30.0)
    step = simulate_rank(s)
    assert step.step_time == 30.0 and step.bound == "host DRAM"


def test_units_stay_resident_from_the_root_on_when_the_host_cannot_hold_them():
    numel = {"": 100, "blocks.0": 50, "blocks.1": 50, "blocks.2": 50}
    host = dataclasses.replace(HOST_PROFILES["server-ddr5-8ch"], pinnable=2 * 16 * 120)  # 120 parameters, 2 ranks
    spec = keep_resident(numel, Offload(host, ranks_per_host=2))
    assert spec.resident == {"", "blocks.0"}
    assert keep_resident(numel, Offload(ranks_per_host=2)).resident == frozenset()
    with pytest.raises(ValueError, match="no unit's model state fits"):
        keep_resident(numel, Offload(dataclasses.replace(host, pinnable=10), ranks_per_host=2))


def test_offload_is_a_sharding_and_its_steps_are_priced(trace):
    assert sharding(MODEL, 8, "fsdp2-offload", None, None).offload == Offload()
    spec = Offload(ranks_per_host=4)
    fs = sharding(MODEL, 8, spec, "nvlink4", None)
    assert fs.offload is spec
    step = rank_step(rank_trace(trace, fs), fs, profile("h100-sxm"))
    assert step.terms["host step"] > 0 and step.terms["H2D"] > 0 and step.step_time >= step.compute_time
    with pytest.raises(ValueError, match="unknown optimizer"):
        Offload(optimizer="lion")
