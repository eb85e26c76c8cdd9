"""bench.host_step_overlap's prediction of the host step, pure: a measured rate in, seconds out (issue 37, item 6).

The rate itself is measured on the machine (Note [Measuring the host step where it runs] in bench/host_profile.py);
here it is given, and the pricing must be the forecast's (``swap.forecast.offload.prices_for``) for the kernel
the runtime ran, and the hidden seconds the worker's first-in, first-out schedule over the gradients' arrivals."""

import pytest
import torch

from bench.host_step_overlap import SKIP, arrival_order, predict, price, simulate
from swap.devices import HostProfile, host_step_bytes, profile
from swap.forecast.offload import prices_for, runtime_format, state_format
from swap.schedule.model_state.plan import Bucket

NUMELS = [262_144, 1_536, 786_432, 9_216]


def test_price_is_the_host_steps_bytes_over_the_measured_rate():
    rate = 4.2e9  # bytes/s of DRAM traffic, as measured
    seconds = price(NUMELS, rate)
    # fp32 AdamW: master, exp_avg and exp_avg_sq read and written, the fp32 gradient read: 28 bytes a parameter
    assert seconds == pytest.approx([28 * n / rate for n in NUMELS], rel=1e-12)
    assert seconds == pytest.approx([host_step_bytes("adamw", n, 4, 4) / rate for n in NUMELS], rel=1e-12)
    # twice the rate, half the seconds; the kernel's own rate is the one used
    assert price(NUMELS, 2 * rate) == pytest.approx([s / 2 for s in seconds], rel=1e-12)
    assert price(NUMELS, rate, kernel="for-loop") == pytest.approx(seconds, rel=1e-12)


def test_price_is_what_the_forecast_prices_for_an_fp32_model_at_that_rate():
    rate = 3.1e9
    buckets = [Bucket(i, (f"p{i}",), n, 4 * n, 4 * n, 4 * n, 8 * n) for i, n in enumerate(NUMELS)]
    fmt = runtime_format(state_format(None, torch.float32), 4)  # what SwapManager keeps for an fp32 model
    host = HostProfile("measured", rate, {"adamw:fused": rate}, 1 << 34, 1 << 33)
    forecast = prices_for(buckets, fmt, profile("h200"), host, "fused").host_step_seconds
    assert list(forecast) == pytest.approx(price(NUMELS, rate, "fused"), rel=1e-12)


def test_simulate_runs_the_buckets_first_in_first_out_from_their_arrivals():
    host = {0: 0.010, 1: 0.020, 2: 0.030}
    # all arrive early: everything done by 0.065, before the backward ends at 0.1: nothing exposed
    assert simulate({0: 0.005, 1: 0.0, 2: 0.001}, host, backward=0.1, gap=0.0) == (pytest.approx(0.06), 0.0)
    # the last arrives at the backward's end: its 30 ms run past it and the 5 ms gap: 25 ms exposed
    seconds, exposed = simulate({0: 0.0, 1: 0.01, 2: 0.1}, host, backward=0.1, gap=0.005)
    assert seconds == pytest.approx(0.06) and exposed == pytest.approx(0.025)
    # queued behind a busy worker: bucket 1 arrives at 0.085, waits for bucket 0 (0.08 .. 0.09), runs to 0.11
    seconds, exposed = simulate({0: 0.08, 1: 0.085, 2: 0.09}, host, backward=0.1, gap=0.0)
    assert exposed == pytest.approx(0.08 + 0.01 + 0.02 + 0.03 - 0.1)


def _today(final: dict[int, float], backward: float, gap: float) -> dict:
    steps = SKIP + 3
    return {"final": [final] * steps, "backward": [backward] * steps, "gap": [gap] * (steps - 1),
            "report": {"bucket_specs": [{"numel": n} for n in NUMELS], "host_bytes_predicted": 1000,
                       "speculation": {"rollback_bytes_predicted": 600}}}  # fmt: skip


def test_predict_prices_each_bucket_and_schedules_it_at_todays_arrivals():
    rate = 2.0e9
    final = {0: 0.09, 1: 0.06, 2: 0.03, 3: 0.0}  # the backward finishes the last bucket first
    p = predict(_today(final, backward=0.1, gap=0.002), rate, "fused")
    per = price(NUMELS, rate)
    assert p["host_step_seconds"] == pytest.approx(sum(per))
    free = 0.0
    for b in (3, 2, 1, 0):
        free = max(free, final[b]) + per[b]
    assert p["exposed_seconds"] == pytest.approx(max(0.0, free - 0.102))
    assert p["hidden_seconds"] == pytest.approx(p["host_step_seconds"] - p["exposed_seconds"])
    assert p["host_bytes"] == 1600  # the runtime's prediction plus the rollback copies


def test_arrival_order_sorts_the_buckets_by_when_their_gradients_were_final():
    run = {"final": [{0: 9.0}] * SKIP + [{0: 0.3, 1: 0.2, 2: 0.1, 3: 0.0}] * 3}  # the first SKIP steps are not read
    assert arrival_order(run, NUMELS) == ([9_216, 786_432, 1_536, 262_144], [0.0, 0.1, 0.2, 0.3])
