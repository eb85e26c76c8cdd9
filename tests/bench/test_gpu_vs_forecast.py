"""bench/gpu_vs_forecast.py forecasts the lease's runs as they ran: its swapped ResNet is tests/gpu/swap_worker.py's
(the worker is not importable as a package, so the bench writes it out and this holds the copy to it), and its
table's error and summary say what the rows hold."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from bench import gpu_vs_forecast as vs
from swap.forecast import zoo

ROOT = Path(__file__).resolve().parents[2]


def test_swapped_resnet_is_the_workers():
    spec = importlib.util.spec_from_file_location("swap_worker_for_vs", ROOT / "tests" / "gpu" / "swap_worker.py")
    assert spec is not None and spec.loader is not None
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    build, batch, size = worker.MODELS["resnet"]
    assert (batch, size) == (vs.LAG_MODEL["batch"], vs.LAG_MODEL["size"])
    with torch.device("meta"):
        theirs, ours = build(zoo), vs.lag_resnet()
    assert [p.shape for p in theirs.parameters()] == [p.shape for p in ours.parameters()]
    source = (ROOT / "tests" / "gpu" / "swap_worker.py").read_text()
    assert f'min_bytes="{vs.LAG_MODEL["min_bytes"]}"' in source
    assert f'lr={vs.LAG_MODEL["lr"]}, momentum=0.9' in source
    assert f'"--policy", default="{vs.LAG_MODEL["policy"]}"' in source


def test_error_and_summary():
    sec = vs.section("m b1", "m", "a.json", "`swap.plan(...)`", "nothing")
    vs.row(sec, "peak", 100 << 20, 90 << 20, "bytes", "peak_key", "peak_field", headline=True)
    vs.row(sec, "step", 2.0, 3.0, "s", "step_key", "a formula", kind="derived")
    vs.row(sec, "unmeasured", None, 1.0, "s", "k", "f")
    errors = [r["error"] for r in sec["rows"]]
    assert abs(errors[0] + 0.1) < 1e-12 and abs(errors[1] - 0.5) < 1e-12 and errors[2] is None
    env = {"machine": "x86_64 CPU, no GPU", "torch": "t", "git_commit": "c"}
    md = vs.markdown({"lease_environment": {}, "forecast_environment": env, "sections": [sec], "seconds": 1.0}, "cmd")
    summary = md.split("## Summary", 1)[1].split("## m b1", 1)[0]
    assert "| m: peak | 100.0 MiB | 90.0 MiB | -10.0 % | simulated |" in summary
    assert "step" not in summary  # not a headline row
    assert "| step | 2.000 s | 3.000 s | +50.0 % | derived | step_key | a formula | - |" in md
    assert "| unmeasured | - | 1.000 s | - |" in md
