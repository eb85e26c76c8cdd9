"""Every GPU script imports, parses its arguments and runs its pure logic on tiny inputs without a GPU, so
none of them rots between the sessions that have a GPU (make gpu runs them for real)."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.gpu import allocator_replay, common, pinned_bandwidth, run, training, vmm_latency
from swap import Sequence

ROOT = Path(__file__).resolve().parents[2]
GPU_TESTS = ROOT / "tests" / "gpu"
CLIS = [vmm_latency, pinned_bandwidth, allocator_replay, training, run]


def test_every_gpu_module_imports():
    for path in sorted((ROOT / "bench" / "gpu").glob("*.py")):
        importlib.import_module(f"bench.gpu.{path.stem}")
    sys.path.insert(0, str(GPU_TESTS))
    try:
        for path in sorted(GPU_TESTS.glob("*.py")):
            importlib.import_module(path.stem)
    finally:
        sys.path.remove(str(GPU_TESTS))


@pytest.mark.parametrize("module", CLIS, ids=lambda m: m.__name__)
def test_cli_help(module, capsys):
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0 and "usage" in capsys.readouterr().out


@pytest.mark.parametrize("worker", ["torch_worker.py", "swap_worker.py"])
def test_gpu_test_workers_parse_arguments(worker):
    r = subprocess.run([sys.executable, str(GPU_TESTS / worker), "--help"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)  # fmt: skip
    assert r.returncode == 0 and "usage" in r.stdout, r.stderr[-2000:]


def test_without_a_gpu_the_gpu_targets_stop_at_once_saying_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = subprocess.run([sys.executable, "-m", "bench.gpu.run", "--check"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)  # fmt: skip
    assert r.returncode == 2
    assert "no NVIDIA GPU available" in r.stderr
    with pytest.raises(common.NoGpu):
        common.require_gpu()
    with pytest.raises(SystemExit) as e:
        training.main(["--seconds", "1"])
    assert e.value.code == 2


def test_percentile_table_slug_and_time_box():
    assert common.percentile([3, 1, 2], 50) == 2
    assert common.percentile([0, 10], 90) == pytest.approx(9)
    with pytest.raises(ValueError):
        common.percentile([], 50)
    assert common.slug("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
    t = common.table(["a", "b"], [[1, 2.34567]])
    assert t[0] == "| a | b |" and t[2] == "| 1 | 2.35 |"
    assert common.TimeBox(100).left() > 99 and common.TimeBox(-1).expired()


def test_write_names_device_driver_torch_and_command(tmp_path):
    env = {"device": "Fake GPU 1", "driver": "driver 580.0", "torch": "2.11.0+cu130", "torch_cuda": "13.0",
           "python": "3.12.3", "git_commit": "abc", "command": "python -m bench.gpu.x", "date": "today"}  # fmt: skip
    from bench.plotting import pyplot

    fig, ax = pyplot().subplots()
    ax.plot([1, 2], [3, 4])
    d = common.write("part", "A part", {"x": 1}, ["| a |"], env, figure=fig, root=tmp_path)
    assert d == tmp_path / "Fake_GPU_1"
    data = json.loads((d / "part.json").read_text())
    assert data["x"] == 1 and data["environment"]["device"] == "Fake GPU 1"
    md = (d / "part.md").read_text()
    for fragment in ("Fake GPU 1", "driver 580.0", "2.11.0+cu130", "python -m bench.gpu.x", "part.png"):
        assert fragment in md
    assert (d / "part.png").stat().st_size > 0


def test_vmm_summary():
    s = vmm_latency.summarize({"cuMemMap": [1000, 2000, 3000, 4000, 100000], "cuMemCreate": []})
    assert s == {"cuMemMap": {"median_us": 3.0, "p90_us": pytest.approx(61.6), "n": 5}}


def test_trace_specs_and_the_policy_model_error():
    assert allocator_replay.parse_trace_spec("resnet50:128") == ("resnet50", 128, False)
    assert allocator_replay.parse_trace_spec("gpt2:8:swap") == ("gpt2", 8, True)
    for bad in ("resnet50", "resnet50:x", "gpt2:8:fast"):
        with pytest.raises(ValueError, match="MODEL:BATCH"):
            allocator_replay.parse_trace_spec(bad)
    from swap.capture import ALLOC, FREE, Trace

    n = 6
    op = np.array([ALLOC, ALLOC, FREE, ALLOC, FREE, FREE], dtype=np.uint8)
    ids = np.array([0, 1, 0, 2, 1, 2])
    size = np.array([3 << 20, 5 << 20, 3 << 20, 1 << 20, 5 << 20, 1 << 20])
    z = np.zeros(n)
    trace = Trace(op, ids, size, np.zeros(n, np.uint8), np.zeros(n, np.int64), z, z, {})
    # The vmalloc model (sim backend) reserves whole 2 MiB chunks: 4 + 6 MiB at the peak.
    err = allocator_replay.model_error(trace, "vmalloc", 10 << 20)
    assert err == pytest.approx(0.0)
    assert allocator_replay.model_error(trace, "native", 1 << 30) < 0


def tiny_sequence():
    n_layers = 4
    var = list(range(n_layers)) + list(reversed(range(n_layers)))
    kind = ["save"] * n_layers + ["use"] * n_layers
    return Sequence(var, kind, [100 << 20] * n_layers, [50 << 20] * (2 * n_layers), [0.01] * (2 * n_layers))


def test_training_predictions_and_tables():
    seq = tiny_sequence()
    pred = training.predictions(seq, 20e9, 20e9, budget=300 << 20)
    assert pred["none"] == pytest.approx(0.08)
    assert pred["checkpoint"] == pytest.approx(0.12)  # the forward (four saves) again
    assert pred["save_on_cpu"] == pytest.approx(0.08 + 2 * (400 << 20) / 20e9)
    assert pred["all"] >= pred["none"] and pred["window"] >= pred["none"]
    rows = [
        {"model": "gpt2", "allocator": "native", "batch": 4, "mode": "window", "throughput": 100.0,
         "peak_allocated": 1 << 30, "predicted_seconds": pred},
        {"model": "gpt2", "allocator": "native", "batch": 4, "mode": "checkpoint", "throughput": 90.0,
         "peak_allocated": 1 << 30},
        {"model": "gpt2", "allocator": "vmalloc", "batch": 8, "mode": "none", "oom": True},
    ]  # fmt: skip
    training.attach_predictions(rows)
    assert rows[1]["predicted_throughput"] == pytest.approx(4 * training.SEQ_LEN / pred["checkpoint"])
    md = "\n".join(training.markdown(rows))
    assert "OOM" in md and "tokens/s" in md
    training.plot(rows)


def test_bench_run_commands_and_parts():
    assert set(run.PARTS) == {"vmm", "pinned", "replay", "training"}
    assert sum(s for _, s in run.PARTS.values()) <= 11 * 60
    cmd = run.command("training", 0.5)
    assert cmd[1:4] == ["-m", "bench.gpu.training", "--seconds"] and cmd[4] == "180"
