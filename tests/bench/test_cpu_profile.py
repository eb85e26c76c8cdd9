"""The CPU profile from its measurements (bench/cpu_profile.py, Note [The CPU as a device]) and the time
comparison's arithmetic (bench/plan_vs_reality_time.py): pure functions, no timing."""

import dataclasses
import functools
import json

import pytest

from bench.cpu_profile import CpuMeasurements, CpuProfile, fit_copy_costs, load, median_of, profile_from
from bench.plan_vs_reality_time import compare, predict, swapped_seconds
from swap.forecast import zoo

MiB = 1 << 20

# 1 GFLOP in 10 ms; 3 x 8 MiB in 1 ms; 8 MiB copied in 2 ms; a 1000-operator step of 12 ms (2 of roofline),
# 32 ms under the manager.
M = CpuMeasurements(matmul_n=500, matmul_seconds=0.25e-2, mul_bytes=8 * MiB, mul_seconds=1e-3, copy_bytes=8 * MiB,
                    copy_seconds=2e-3, tiny_ops=1000, tiny_roofline_seconds=2e-3, tiny_step_seconds=12e-3,
                    tiny_managed_step_seconds=32e-3, threads=1, memory=24 << 30)  # fmt: skip


def test_the_profile_is_what_was_measured():
    p = profile_from(M, "test cpu")
    d = p.device
    assert d.fp32_flops == d.lowp_flops == pytest.approx(2 * 500**3 / 0.25e-2)  # 100 GFLOP/s
    assert d.mem_bandwidth == pytest.approx(3 * 8 * MiB / 1e-3)
    assert d.efficiency == 1.0 and d.memory == 24 << 30
    # The step less its roofline, per operator; what the manager adds on top, per operator.
    assert d.op_overhead == pytest.approx(10e-6) and p.runtime_op_overhead == pytest.approx(20e-6)
    assert p.link_bandwidth == d.h2d_bandwidth == d.d2h_bandwidth == pytest.approx(8 * MiB / 2e-3)
    # An operator of 1 GFLOP and 1 MB: compute-bound, plus the overhead.
    assert d.step_seconds(1e9, 1e6) == pytest.approx(1e-2 + 10e-6)


def test_noise_never_makes_an_overhead_negative_and_nonsense_is_refused():
    faster = dataclasses.replace(M, tiny_step_seconds=1e-3, tiny_managed_step_seconds=0.5e-3)
    p = profile_from(faster)
    assert p.device.op_overhead == 0.0 and p.runtime_op_overhead == 0.0
    with pytest.raises(ValueError, match="no operators"):
        profile_from(dataclasses.replace(M, tiny_ops=0))
    with pytest.raises(ValueError, match="positive"):
        profile_from(dataclasses.replace(M, copy_seconds=0.0))


def test_the_profile_round_trips_and_a_missing_file_says_how_to_make_one(tmp_path):
    p = profile_from(M)
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"profile": p.to_json()}))
    assert load(path) == p and isinstance(load(path), CpuProfile)
    with pytest.raises(FileNotFoundError, match="python -m bench.cpu_profile"):
        load(tmp_path / "none.json")


def test_operator_classes_get_their_measured_rates_and_round_trip(tmp_path):
    # tanh: 2 GB in 1 s over two calls (bytes only: total over total). Convolutions: calls that take exactly
    # FLOPs / 100 GFLOP/s + bytes / 10 GB/s. Attention: 1 GFLOP in 0.1 s at head dim 8, in 0.02 s at 64.
    convs = [(f, b, f / 100e9 + b / 10e9) for f, b in [(1e9, 1e8), (4e9, 1e7), (1e8, 5e7)]]
    m = dataclasses.replace(M, classes={"tanh": [(0.0, 0.5e9, 0.5), (0.0, 1.5e9, 0.5)], "conv": convs},
                            attention={64: (1e9, 0.02), 8: (1e9, 0.1)})  # fmt: skip
    d = profile_from(m).device
    assert d.class_rates["tanh"] == pytest.approx((0.0, 2e9))
    assert d.class_rates["conv"] == pytest.approx((100e9, 10e9))
    assert [h for h, _ in d.attention_flops] == [8, 64]  # sorted by head dim
    assert [r for _, r in d.attention_flops] == pytest.approx([10e9, 50e9])
    assert profile_from(M).device.class_rates is None  # nothing measured: the roofline alone
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"profile": profile_from(m).to_json()}))
    assert load(path) == profile_from(m)
    with pytest.raises(ValueError, match="no operator class"):
        profile_from(dataclasses.replace(m, classes={"sparkle": [(0.0, 1.0, 1.0)]}))
    with pytest.raises(ValueError, match="positive"):
        profile_from(dataclasses.replace(m, attention={8: (1e9, 0.0)}))


def test_fresh_pages_cost_what_a_large_output_adds_over_a_warm_buffer():
    d = profile_from(dataclasses.replace(M, fresh_bytes=64 * MiB, fresh_seconds=0.03, warm_seconds=0.01)).device
    assert d.fresh_page_bandwidth == pytest.approx(64 * MiB / 0.02)
    no_penalty = dataclasses.replace(M, fresh_bytes=64 * MiB, fresh_seconds=0.01, warm_seconds=0.011)
    assert profile_from(no_penalty).device.fresh_page_bandwidth == 0.0  # faster fresh: noise, nothing to add


def test_rounds_give_the_median_of_each_time():
    rounds = [dataclasses.replace(M, matmul_seconds=t, classes={"tanh": [(0.0, 1e9, t)]}, attention={8: (1e9, t)})
              for t in (3.0, 1.0, 2.0)]  # fmt: skip
    m = median_of(rounds)
    assert m.matmul_seconds == 2.0 and m.classes["tanh"] == [(0.0, 1e9, 2.0)] and m.attention[8] == (1e9, 2.0)
    assert m.copy_seconds == M.copy_seconds and m.tiny_ops == M.tiny_ops


def test_swapped_steps_pay_every_copy_and_ratios_compare_strategies():
    assert swapped_seconds(1.0, 3 * 10**9, 10**9, 4e9) == pytest.approx(2.0)
    predicted = {"plain": 1.0, "checkpointed": 1.2, "swapped": 1.5}
    c = compare(predicted, {"plain": 2.0, "checkpointed": 2.6, "swapped": 3.0})
    assert c["error"] == pytest.approx({"plain": -0.5, "checkpointed": -1.4 / 2.6, "swapped": -0.5})
    assert c["ratio"]["checkpointed"]["predicted"] == pytest.approx(1.2)
    assert c["ratio"]["checkpointed"]["measured"] == pytest.approx(1.3)
    assert c["ratio"]["checkpointed"]["error"] == pytest.approx(1.2 / 1.3 - 1)
    assert c["ratio"]["swapped"]["error"] == pytest.approx(0.0)


def swapping_steps(per_copy: float, bandwidth: float) -> list[tuple[int, int, int, float, float]]:
    """Planned MLP steps that cost the plain step + M's 20 us per operator + ``per_copy`` per copy + their bytes
    at ``bandwidth``."""
    shapes = [(300, 40, 10 * MiB, 5e-3), (300, 40, 40 * MiB, 30e-3), (600, 80, 40 * MiB, 20e-3)]
    return [(ops, copies, nbytes, plain, plain + ops * 20e-6 + copies * per_copy + nbytes / bandwidth)
            for ops, copies, nbytes, plain in shapes]  # fmt: skip


def test_a_planned_steps_copies_cost_per_copy_and_per_byte():
    p = profile_from(dataclasses.replace(M, swap_steps=swapping_steps(50e-6, 3e9)))
    assert p.runtime_save_overhead == pytest.approx(50e-6) and p.runtime_copy_bandwidth == pytest.approx(3e9)
    assert p.copy_bandwidth == p.runtime_copy_bandwidth != p.link_bandwidth
    # Bytes alone (the per-copy term fits to about zero or below: dropped), or nothing left to price at all.
    bytes_only = fit_copy_costs(dataclasses.replace(M, swap_steps=swapping_steps(-1e-6, 3e9)), 20e-6)
    assert bytes_only[0] == 0.0 and bytes_only[1] == pytest.approx(3e9, rel=0.05)
    free = [(ops, c, b, plain, plain) for ops, c, b, plain, _ in swapping_steps(0.0, 3e9)]
    assert fit_copy_costs(dataclasses.replace(M, swap_steps=free), 20e-6) == (0.0, 0.0)
    with pytest.raises(ValueError, match="must copy"):
        profile_from(dataclasses.replace(M, swap_steps=[(300, 0, 0, 5e-3, 6e-3)]))
    # Rounds: the median of each step's times, its counts kept.
    rounds = [dataclasses.replace(M, swap_steps=swapping_steps(x, 3e9)) for x in (10e-6, 30e-6, 20e-6)]
    assert median_of(rounds).swap_steps == swapping_steps(20e-6, 3e9)


def test_profiles_without_the_copy_costs_still_load_and_price_bytes_at_the_link(tmp_path):
    p = profile_from(dataclasses.replace(M, swap_steps=swapping_steps(50e-6, 3e9)))
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"profile": p.to_json()}))
    assert load(path) == p
    old = p.to_json()
    del old["runtime_save_overhead"], old["runtime_copy_bandwidth"]
    path.write_text(json.dumps({"profile": old}))
    assert load(path).runtime_save_overhead == 0.0 and load(path).copy_bandwidth == p.link_bandwidth


def test_a_swapped_prediction_grows_by_the_cost_per_copy_times_the_copies():
    assert swapped_seconds(1.0, 3 * 10**9, 10**9, 4e9, copies=100, per_copy=1e-3) == pytest.approx(2.1)
    model_fn = functools.partial(zoo.resnet, (1, 1), 16, 10)
    spec = {"model_fn": model_fn, "batch_fn": lambda n: zoo.example_batch(model_fn(), n, 64), "batch": 8,
            "loss_fn": None}  # fmt: skip
    cpu = profile_from(M)
    base = predict(spec, cpu)
    dear = predict(spec, dataclasses.replace(cpu, runtime_save_overhead=1e-3))
    assert base["copies"] > 0  # the window schedule swaps at a budget halfway to the unswapped peak
    assert dear["swapped"] - base["swapped"] == pytest.approx(base["copies"] * 1e-3)
    assert dear["plain"] == base["plain"] and dear["checkpointed"] == base["checkpointed"]
