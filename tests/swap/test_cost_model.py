"""The cost model's calibration and the swap-schedule benchmark's schema (the max-batch predictor,
``swap.plan``, is tested in tests/plan)."""

import json

import pytest

from bench import swap_schedule
from bench.traces import capture
from swap.devices import PROFILES, profile
from swap.forecast.from_trace import sequence_from_trace


def test_v100_profile_reproduces_the_papers_no_swap_baseline():
    trace = capture("resnet50", 64, steps=2, progress=False)
    dev = profile("v100")
    seq = sequence_from_trace(trace, cost=dev)
    images_per_s = 64 / sum(seq.compute)
    assert images_per_s == pytest.approx(336, rel=0.03)  # window-scheduling paper, Table 1: V100, batch 64


def test_profiles_are_documented_data():
    for p in PROFILES.values():
        assert p.fp32_flops > 1e12 and p.h2d_bandwidth > 1e9 and p.memory >= 8 << 30  # rtx2080ti-11gb: 11 GiB
        assert p.step_seconds(2e12, 0) == pytest.approx(2e12 / (p.fp32_flops * p.efficiency))
    with pytest.raises(ValueError, match="unknown device profile"):
        profile("tpu")


def test_quick_mode_writes_the_schema(tmp_path):
    assert swap_schedule.main(["--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "swap_schedule.json").read_text())
    rows = results["workloads"]["resnet50"]
    assert [r["batch"] for r in rows] == [64, 256]
    for r in rows:
        for col in ("none", "fixed_distance", "all", "window", "window+vmalloc", "window+bestfit"):
            assert col in r
        w = r["window"]
        assert {"step_time", "stall", "lower_bound", "peak", "h2d_bytes", "d2h_bytes", "images_per_s"} <= set(w)
        assert w["step_time"] >= w["lower_bound"] * 0.999 and w["peak"] <= results["meta"]["budget"]
    assert rows[1]["none"] is None  # batch 256 does not fit 16 GiB without swapping (20.9 GiB)
    assert set(results["targets"]) and results["paper"]["batches"][0] == 64
    for name in ("swap_schedule.md", "swap_schedule_throughput.png", "swap_schedule_timeline.png"):
        assert (tmp_path / name).stat().st_size > 0
