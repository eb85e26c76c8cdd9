"""``make gpu-quick``'s runner (bench/gpu/quick.py) without a GPU: each check in a process of its own under a
time limit, PASS/FAIL with its figure, logs and a summary JSON; and no GPU means a clear exit at once. The
GPU checks themselves (bench/gpu/quick_checks.py) are stood in for by tests/gpu/quick_fakes.py, except the
host-waits check, whose training also runs on the CPU."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.gpu import quick

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def child_env(**extra):
    path = os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, **extra)


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # a zombie is dead, only not reaped yet
    except FileNotFoundError:
        return True


@pytest.mark.cpu
def test_each_check_runs_alone_and_one_that_hangs_or_dies_costs_only_itself(tmp_path):
    import quick_fakes

    pid_file = tmp_path / "sleeper.pid"
    said = []
    t0 = time.monotonic()
    results = quick.run_checks(quick_fakes.CHECKS, "quick_fakes", tmp_path / "logs",
                               child_env(QUICK_FAKE_PID_FILE=str(pid_file)), said.append)  # fmt: skip
    assert time.monotonic() - t0 < 60, "the hanging check was not stopped at its limit"
    by = {r["name"]: r for r in results}
    assert [r["status"] for r in results] == ["PASS", "FAIL", "FAIL", "FAIL", "FAIL"]
    assert by["passes"]["figure"] == "42 things" and by["passes"]["data"] == {"n": 42}
    assert by["fails"]["figure"] == "7 over the budget"
    assert by["raises"]["figure"] == "ValueError: the adapter is a fake"
    assert by["hangs"]["figure"].startswith("timed out after 3 s (last output: waiting for a device")
    assert by["dies"]["figure"] == "its process exited with 3 before a result (last output: about to die)"
    assert "PASS passes" in said[1] and said[3].startswith("FAIL fails") and len(said) == 10
    log = (tmp_path / "logs" / "quick-checks.log").read_text()  # every check's output, one section each
    sections = log.split("===== ")[1:]
    assert [s.split(":")[0] for s in sections] == [c.name for c in quick_fakes.CHECKS]
    assert "Traceback" in sections[2] and "ValueError: the adapter is a fake" in sections[2]
    sleeper = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while not gone(sleeper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(sleeper), "a process the hanging check started outlived its time limit"


@pytest.mark.cpu
def test_the_whole_run_keeps_to_its_time_and_says_what_it_did_not_run(tmp_path):
    import quick_fakes

    hangs, passes = (next(c for c in quick_fakes.CHECKS if c.name == n) for n in ("hangs", "passes"))
    results = quick.run_checks([hangs, passes], "quick_fakes", tmp_path, child_env(QUICK_FAKE_PID_FILE=str(
        tmp_path / "pid")), lambda line: None, seconds=2)  # fmt: skip
    assert results[0]["figure"].startswith("timed out after 2 s")
    assert results[1]["status"] == "FAIL" and results[1]["figure"] == "not run: the 2 s of the whole run were used up"


@pytest.mark.cpu
def test_the_summary_is_written_under_the_device_and_copied_to_the_logs(tmp_path):
    results = [{"name": "passes", "what": "w", "status": "PASS", "figure": "42 things", "seconds": 1.0,
                "limit_s": 60, "data": {}}]  # fmt: skip
    env = {"device": "NVIDIA H200", "torch": "2.11.0", "torch_cuda": "13.0", "python": "3.12", "git_commit": "abc",
           "command": "python -m bench.gpu.quick", "date": "today", "driver": None}  # fmt: skip
    d = quick.write_summary(results, env, tmp_path / "logs", root=tmp_path / "results")
    assert d == tmp_path / "results" / "NVIDIA_H200"
    summary = json.loads((d / "quick.json").read_text())
    assert summary["passed"] == 1 and summary["checks"][0]["figure"] == "42 things"
    assert summary["environment"]["device"] == "NVIDIA H200"
    assert (tmp_path / "logs" / "quick.json").read_text() == (d / "quick.json").read_text()
    assert "| PASS | passes | 42 things |" in (d / "quick.md").read_text()


@pytest.mark.cpu
def test_without_a_gpu_it_stops_at_once_saying_why(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    r = subprocess.run([sys.executable, "-m", "bench.gpu.quick", "--out", str(tmp_path)], cwd=ROOT,
                       env=child_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no NVIDIA GPU available" in r.stderr and "sees no CUDA device" in r.stderr
    assert list(tmp_path.iterdir()) == []  # no check ran


@pytest.mark.cpu
def test_unknown_check_names_are_refused_naming_them():
    with pytest.raises(SystemExit) as e:
        quick.main(["--only", "adapter", "warp_drive"])
    assert e.value.code == 2


@pytest.mark.cpu
def test_the_host_waits_check_runs_in_its_own_process_on_the_cpu(tmp_path):
    """The real check's code path (its training runs on the CPU too): a planned iteration waits on no copy."""
    check = next(c for c in quick.importlib.import_module("bench.gpu.quick_checks").CHECKS if c.name == "host_waits")
    r = quick.run_check(check, "bench.gpu.quick_checks", tmp_path, child_env())
    assert r["status"] == "PASS", r
    planned = [n for mode, n in r["data"]["per_iteration"] if mode == "planned"]
    assert planned and not any(planned)


@pytest.mark.cpu
def test_the_region_events_check_reruns_regions_on_the_cpu(tmp_path):
    """The real check's code path: the checkpoint it forces must make regions that rerun, else the check proves
    nothing (on the 2026-11-28 H200 lease it ran no region: "0 marks ... 0 regions, 0 reruns")."""
    check = next(c for c in quick.importlib.import_module("bench.gpu.quick_checks").CHECKS if c.name == "region_events")
    r = quick.run_check(check, "bench.gpu.quick_checks", tmp_path, child_env())
    assert r["status"] == "PASS", r
    assert r["data"]["regions"] > 0 and r["data"]["reruns"] > 0, r
    assert r["data"]["marks"] <= 2 * r["data"]["regions"]
