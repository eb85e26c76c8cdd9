"""swap.plan on a model of the user's own: the largest batch per policy, its speed, the table and figure,
the allocators, device profiles and a measured profile, and the command line."""

import functools
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import TinyCNN, cnn_batch

import swap
from swap.capture import capture
from swap.cli import main
from swap.devices import ALIASES, PROFILES, profile
from swap.forecast.from_trace import sequence_from_trace

ROOT = Path(__file__).resolve().parents[2]
KiB = 1024


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def peak(n: int) -> int:
    """The steady-state peak without swapping at batch n, from a capture of that batch itself."""
    return sequence_from_trace(capture(TinyCNN, cnn_batch, n, optimizer=sgd), min_bytes=16 * KiB).no_swap_peak()


BUDGET = 2_500_000  # bytes: 47 samples of TinyCNN without swapping, twice that with


@functools.cache
def planned(allocator=None):
    return swap.plan(TinyCNN, cnn_batch, budget=BUDGET, device="a100-40gb", allocator=allocator, optimizer=sgd,
                     min_bytes=16 * KiB, progress=False)  # fmt: skip


def test_swap_plan_is_the_function_and_python_m_swap_plan_the_command_line():
    assert callable(swap.plan) and swap.plan.__module__ == "swap.forecast.planner"
    with pytest.raises(ImportError, match="swap.plan is the planning function"):
        importlib.import_module("swap.plan")
    assert callable(swap.plan)  # the failed import did not replace it
    out = subprocess.run([sys.executable, "-m", "swap.plan", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "--budget" in out.stdout and "FILE.py:FUNCTION" in out.stdout


def test_the_largest_batch_without_swapping_is_exact():
    p = planned()
    n = p.max_batch["none"]
    assert peak(n) <= BUDGET < peak(n + 1)  # checked against captures of those batches themselves
    assert p.linear and n in p.captures  # scaled from small captures, and the answer verified by a capture


def test_plan_fields():
    p = planned()
    assert set(p.max_batch) == set(p.throughput) == {"none", "window", "fixed_distance", "all"}
    assert p.max_batch["window"] > p.max_batch["none"] > 0
    assert p.max_batch["all"] >= p.max_batch["none"]
    for policy, n in p.max_batch.items():
        r = p.policies[policy]
        assert p.throughput[policy] == pytest.approx(n / r.step_time)
        assert r.peak <= BUDGET
    # Swapping costs time at equal batch; the window policy is at least as fast as vDNN's "all".
    assert p.policies["window"].swapped_bytes > 0 and p.policies["none"].swapped_bytes == 0
    assert p.throughput["window"] >= p.throughput["all"] * 0.999
    assert 0 < p.window <= BUDGET


def test_table_and_plot(tmp_path):
    p = planned()
    table = p.table()
    for policy, n in p.max_batch.items():
        assert any(line.split()[:2] == [policy, str(n)] for line in table.splitlines())
    assert "A100-40GB" in table and "budget 2.38 MiB" in table
    png = p.plot(tmp_path / "memory.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    m = p.memory
    assert max(m["unswapped"]) > BUDGET >= max(m["swapped"]) and m["batch"] == p.max_batch["window"]


def test_allocators_hold_at_least_the_live_bytes():
    ideal = planned(None)
    for allocator in ("vmalloc", "pytorch_native"):
        p = planned(allocator)
        assert 0 < p.max_batch["none"] <= ideal.max_batch["none"], allocator
        assert p.max_batch["window"] <= ideal.max_batch["window"], allocator
    with pytest.raises(ValueError, match="unknown allocator"):
        swap.plan(TinyCNN, cnn_batch, budget=BUDGET, allocator="jemalloc", progress=False)


def test_device_profiles():
    for name in ("v100-16gb", "a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "l4", "rtx4090"):
        p = profile(name)
        assert p.fp32_flops > 1e12 and p.lowp_flops > p.fp32_flops and p.mem_bandwidth > 1e11
        assert p.h2d_bandwidth > 1e10 and p.memory >= 16 << 30 and p.source
    assert profile("v100") is PROFILES["v100-16gb"] and profile("H100") is PROFILES["h100-sxm"]
    assert PROFILES["p100"] is PROFILES["p100-16gb"] and "p100" not in PROFILES  # old names index, not listed
    assert set(ALIASES) == {"v100", "p100", "h100"}
    assert profile("v100-16gb").h2d_bandwidth == 50e9  # the window-scheduling paper's NVLink to the POWER9
    with pytest.raises(ValueError, match="unknown device profile"):
        profile("tpu")


def test_a_measured_profile_replaces_the_datasheet(tmp_path):
    # What SwapManager.save_profile writes: a sequence with per-step times, and measured bandwidths.
    seq = sequence_from_trace(capture(TinyCNN, cnn_batch, 8, optimizer=sgd), min_bytes=16 * KiB)
    seq.compute = [0.002] * len(seq)
    path = seq.save(tmp_path / "profile.json", {"device": "test GPU", "h2d_bandwidth": 3e9, "d2h_bandwidth": 2e9,
                                                "batch": 8})  # fmt: skip
    p = swap.plan(TinyCNN, cnn_batch, budget=BUDGET, device="l4", allocator=None, optimizer=sgd, min_bytes=16 * KiB,
                  profile=str(path), policies=("none", "window"), progress=False)  # fmt: skip
    assert p.device.h2d_bandwidth == 3e9 and p.device.d2h_bandwidth == 2e9 and "test GPU" in p.device.name
    # The roofline at batch 8 now takes the measured 2 ms per step.
    again = sequence_from_trace(capture(TinyCNN, cnn_batch, 8, optimizer=sgd),
                                cost=p.device, min_bytes=16 * KiB)  # fmt: skip
    assert sum(again.compute) == pytest.approx(0.002 * len(seq), rel=1e-6)
    # Without the batch in the file, it is found from the profile's saved bytes.
    path = seq.save(tmp_path / "nobatch.json", {"h2d_bandwidth": 3e9, "d2h_bandwidth": 2e9})
    q = swap.plan(TinyCNN, cnn_batch, budget=BUDGET, device="l4", allocator=None, optimizer=sgd, min_bytes=16 * KiB,
                  profile=str(path), policies=("none",), progress=False)  # fmt: skip
    assert q.device.efficiency == pytest.approx(p.device.efficiency)


USER_FILE = '''
import torch
from torch import nn

def model_fn():
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 256), nn.ReLU(), nn.Linear(256, 10))

def batch_fn(n):
    return torch.randn(n, 3, 16, 16), torch.randint(0, 10, (n,))
'''


def test_the_command_line_on_a_users_file(tmp_path, capsys):
    f = tmp_path / "my_model.py"
    f.write_text(USER_FILE)
    args = ["--model", f"{f}:model_fn", "--batch", f"{f}:batch_fn", "--budget", "8MiB", "--device", "rtx4090",
            "--min-bytes", "16KiB", "--quiet", "--plot", str(tmp_path / "m.png")]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[3:7]}
    assert set(rows) == {"none", "window", "fixed_distance", "all"}
    assert int(rows["window"]) >= int(rows["none"]) > 0
    assert (tmp_path / "m.png").stat().st_size > 0
    # Without :FUNCTION the conventional names are used; a missing function is named, with what exists.
    assert main(["--model", str(f), "--batch", str(f), "--budget", "8MiB", "--quiet", "--policies", "none"]) == 0
    with pytest.raises(SystemExit):
        main(["--model", f"{f}:nope", "--batch", str(f), "--budget", "8MiB"])
    assert "has no function 'nope'; it defines: batch_fn, model_fn" in capsys.readouterr().err


def test_the_command_line_keeps_the_built_in_models(capsys):
    args = ["--model", "unet", "--size", "32", "--budget", "1GiB", "--device", "v100", "--allocator", "ideal",
            "--policies", "none,window", "--strategies", "off", "--quiet"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[3:5]}
    assert int(rows["window"]) > int(rows["none"]) > 0


def test_a_budget_above_the_device_memory_is_refused_before_any_capture(capsys):
    # `--model resnet50 --budget 500GiB --device v100-16gb` once planned batch 45,307 with a planned peak of
    # 499.94 GiB on a 16 GB V100; such a budget is refused (Note [A budget above the device's memory] in
    # swap/schedule/budget.py).
    with pytest.raises(SystemExit) as e:
        main(["--model", "resnet50", "--budget", "500GiB", "--device", "v100-16gb", "--quiet"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "a budget of 500.00 GiB is more than the memory of v100-16gb (16.00 GiB): pass --budget 16GiB or less" in err
    assert "--device" not in err.split("or less")[1]  # no profile has 500 GiB, so none is proposed
    with pytest.raises(SystemExit):
        main(["--model", "resnet50", "--budget", "20GiB", "--device", "v100", "--quiet"])
    assert "or a device with that much memory (--device a100-40gb; also a100-80gb" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"more than the memory of v100-16gb \(16.00 GiB\): pass budget='16GiB' or "
                                         r"less, or a device with that much memory \(device='a100-40gb'"):  # fmt: skip
        swap.plan(TinyCNN, cnn_batch, budget="17GiB", device="v100-16gb", progress=False)
    assert swap.plan(TinyCNN, cnn_batch, budget="16GiB", device="v100-16gb", optimizer=sgd, policies=("none",),
                     max_batch=4, progress=False).max_batch["none"] == 4  # all of the memory is allowed  # fmt: skip
