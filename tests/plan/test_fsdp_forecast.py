"""The forecast of one FSDP2 rank (Note [One rank of FSDP2], Note [Collectives on the step]): the rank's trace,
the collectives' price, the arguments, and the forecast against two gloo ranks' measured peak."""

import functools

import pytest

from bench import fsdp_cpu
from bench.ranks import spawn
from swap.capture import capture
from swap.capture.trace import ALLOC, TAG, live_peak
from swap.cli import main
from swap.devices import INTERCONNECTS, InterconnectProfile, profile
from swap.forecast.distributed import exposed_collectives, fsdp2, rank_trace, sharding
from swap.schedule.model_state.units import shard_of

LAYERS, D, BATCH = 3, 128, 6
MODEL = functools.partial(fsdp_cpu.model_fn, LAYERS, D)


@pytest.fixture(scope="module")
def trace():
    return capture(MODEL, fsdp_cpu.batch_fn, BATCH, fsdp_cpu.loss_fn, steps=2, target="cpu")


def test_a_shard_pads_dim_0_to_a_multiple_of_the_world_size():
    assert shard_of((10, 4), 4, 4) == 3 * 4 * 4  # 10 rows over 4 ranks: 3 each (12, padded)
    assert shard_of((8,), 2, 8) == 2
    assert shard_of((), 4, 8) == 4


def test_each_block_and_the_root_are_units_and_a_rank_holds_its_shards(trace):
    fs = fsdp2(MODEL, 2)
    assert [u.path for u in fs.units] == ["", "blocks.0", "blocks.1", "blocks.2"]
    params = sum(p.numel() * 4 for p in MODEL().parameters())
    assert sum(u.param_bytes for u in fs.units) == params
    rank = rank_trace(trace, fs)
    weights = lambda t: int(t.size[(t.op == ALLOC) & (t.tag == TAG["weight"])].sum())  # noqa: E731
    state = lambda t: int(t.size[(t.op == ALLOC) & (t.tag == TAG["optimizer_state"])].sum())  # noqa: E731
    assert weights(rank) == fs.shard_bytes == params // 2  # every dim 0 here is even: no padding
    assert state(rank) == state(trace) // 2
    assert live_peak(rank) < live_peak(trace)
    assert rank_trace(trace, fsdp2(MODEL, 1)) is trace


def test_the_trace_of_another_model_is_refused(trace):
    with pytest.raises(ValueError, match="do not match the model's parameters"):
        rank_trace(trace, fsdp2(functools.partial(fsdp_cpu.model_fn, LAYERS, 2 * D), 2))


def test_collectives_cost_more_on_a_slower_link_and_a_collective_costs_latency_plus_bytes_over_bus_bandwidth(trace):
    link = InterconnectProfile("test", 10e9, 1e-5)
    assert link.collective_seconds(8e9, 8) == pytest.approx(1e-5 + 8e9 * 7 / 8 / 10e9)
    assert link.collective_seconds(8e9, 1) == 0.0
    dev = profile("h100-sxm")
    fast = exposed_collectives(trace, fsdp2(MODEL, 8, "nvlink4"), dev)
    slow = exposed_collectives(trace, fsdp2(MODEL, 8, InterconnectProfile("slow", 1e6, 1e-3)), dev)
    assert 0 <= fast < slow
    assert exposed_collectives(trace, fsdp2(MODEL, 1), dev) == 0.0
    assert set(INTERCONNECTS) == {"nvlink4", "ib-ndr400"} and all(p.source for p in INTERCONNECTS.values())


def test_sharding_arguments_say_what_to_pass():
    assert sharding(MODEL, 1, None, None, None) is None
    with pytest.raises(ValueError, match="shard= one of 'fsdp2'"):
        sharding(MODEL, 2, None, None, None)
    with pytest.raises(ValueError, match="pass world_size > 1"):
        sharding(MODEL, 1, None, "nvlink4", None)
    with pytest.raises(ValueError, match="unknown interconnect 'ethernet'"):
        sharding(MODEL, 2, "fsdp2", "ethernet", None)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        sharding(MODEL, 0, "fsdp2", None, None)


def test_the_command_line_forecasts_one_rank(capsys):
    assert main(["--model", "gpt2", "--size", "128", "--budget", "2GiB", "--device", "h100-sxm", "--world-size", "8",
                 "--shard", "fsdp2", "--interconnect", "ib-ndr400", "--policies", "none", "--strategies", "off",
                 "--allocator", "ideal", "--quiet", "--max-batch", "4"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "one rank of FSDP2 over 8 ranks on InfiniBand NDR" in out and "collectives exposed per step" in out
    assert main(["--model", "gpt2", "--budget", "2GiB", "--world-size", "2", "--quiet"]) == 2
    assert "shard= one of 'fsdp2'" in capsys.readouterr().err


@pytest.mark.slow
def test_the_forecast_per_rank_peak_is_within_5_percent_of_two_gloo_ranks():
    predicted = fsdp_cpu.forecast(LAYERS, D, BATCH)
    ranks = spawn(functools.partial(fsdp_cpu.measure, layers=LAYERS, d=D, batch=BATCH))
    measured = max(max(peaks[1:]) for peaks in ranks)  # the first iteration has no optimizer state yet
    assert abs(predicted / measured - 1) <= 0.05, (predicted, ranks)
