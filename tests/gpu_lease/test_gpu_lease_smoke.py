"""``make gpu-lease-smoke``: the lease's every phase on tiny sizes on the CPU, its plumbing for real, so the script is
known to work before it costs device time. The output contract the device tool needs: at most 8 files, none
deeper than two folders, every JSON parses, the summary lists every phase with a status from the known set; and
the CPU stand-ins that can pass do (model state bitwise against its oracle, the allocators' native runs)."""

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from bench.gpu import lease

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_out")
    work = tmp_path_factory.mktemp("work")
    r = subprocess.run([sys.executable, "-m", "bench.gpu.lease", "--smoke", "--out", str(out), "--work", str(work)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)  # fmt: skip
    return out, r


def test_the_output_folder_keeps_to_what_the_device_tool_returns(smoke):
    out, r = smoke
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= lease.MAX_FILES, files
    assert all(len(p.relative_to(out).parts) <= 3 for p in files)  # $OUT/a/b/file at most
    names = {p.name for p in files}
    assert {"lease.log", "summary.md", "lease.json", "failures.xml", "model_state_gpu.json", "alloc_ratio.json",
            "results.tar.gz"} <= names, names  # fmt: skip
    for p in files:
        if p.suffix == ".json":
            json.loads(p.read_text())
    with tarfile.open(out / "results.tar.gz") as tar:
        assert "lease/model_state_gpu.json" in tar.getnames()


def test_the_summary_lists_every_phase_with_its_status(smoke):
    out, r = smoke
    data = json.loads((out / "lease.json").read_text())
    rows = {row["name"]: row for row in data["phases"]}
    assert list(rows) == [ph.name for ph in lease.PHASES], r.stdout[-3000:]
    assert all(row["status"] in lease.STATUSES for row in rows.values())
    md = (out / "summary.md").read_text()
    for name, row in rows.items():
        assert f"| {name} | {row['status']} |" in md
    # what needs CUDA says so; what has a CPU stand-in ran it and passed
    for name in ("orderings_model_state", "orderings_activations", "quick", "adapter", "failures"):
        assert rows[name]["status"] == lease.NO_CUDA, rows[name]
    for name in ("env", "build", "model_state", "alloc"):
        assert rows[name]["status"] == "passed", (rows[name], r.stdout[-3000:])
    assert all(0 < row["box_seconds"] <= 180 for row in rows.values())
    assert data["seconds_used"] < data["seconds_allowed"]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_model_state_and_allocator_results_carry_their_figures(smoke):
    out, _ = smoke
    ms = json.loads((out / "model_state_gpu.json").read_text())
    assert set(ms["runs"]) == {"plain", "ours", "reference", "auto", "cpu_offload"}
    assert ms["compare"]["ours_vs_reference_bitwise"] == {"losses": True, "params_sha256": True, "state_sha256": True,
                                                          "step0_grads": True}  # fmt: skip
    assert ms["runs"]["ours"]["within_budget"] and ms["ok"]
    assert ms["runs"]["ours"]["bytes_per_kind"]["weights_in_bytes"] > 0
    # the users' format: fp32 masters, bf16 compute (the oracle and plain follow it, hence bitwise above)
    assert ms["compute_dtype"].startswith("bf16 compute, fp32 masters")
    assert ms["compare"]["determinism_precheck_step0_loss_equal"]
    ar = json.loads((out / "alloc_ratio.json").read_text())
    natives = [row for row in ar["rows"] if row["allocator"] == "native"]
    assert natives and all(row["throughput"] > 0 and row["alloc_free_ns"]["4KiB"] > 0 for row in natives)
    assert all(row["status"] == "skipped: no CUDA" for row in ar["rows"] if row["allocator"] != "native")
    assert "| failures | skipped: no CUDA |" in (out / "summary.md").read_text()


def test_a_phase_past_its_box_is_stopped_and_the_rest_still_run(tmp_path):
    hang = lease.Phase("hangs", "a phase that outlives its box", 10, lambda c: [sys.executable, "-c",
                       "import time; time.sleep(60)"], lambda c: [sys.executable, "-c", "import time; time.sleep(60)"])
    after = lease.Phase("after", "a phase after it", 10, lambda c: [sys.executable, "-c", "print('ran')"],
                        lambda c: [sys.executable, "-c", "print('ran')"])  # fmt: skip
    run = lease.Lease(tmp_path / "out", tmp_path / "work", 120, True, [hang, after])
    assert run.main() == 1
    rows = json.loads((tmp_path / "out" / "lease.json").read_text())["phases"]
    assert [r["status"] for r in rows] == ["timed out", "passed"]
    assert rows[0]["seconds"] < 30 and rows[0]["figure"].startswith("timed out after its 10 s box")


def test_phases_that_find_no_time_left_say_so(tmp_path):
    quick = lease.Phase("quick", "q", 60, lambda c: [sys.executable, "-c", "pass"], lambda c: [sys.executable, "-c",
                        "pass"])  # fmt: skip
    run = lease.Lease(tmp_path / "out", tmp_path / "work", lease.RESERVE + 5, True, [quick])
    run.main()
    row = json.loads((tmp_path / "out" / "lease.json").read_text())["phases"][0]
    assert row["status"] == "skipped: no time"


def test_the_gpu_commands_parse_and_name_what_exists(tmp_path):
    """The lease's GPU-only commands are checked here, where they cost nothing: a flag the script does not take,
    a gpu-quick check or a failure test that is not there would waste a lease."""
    from bench.gpu import alloc_ratio, model_state_gpu, quick_checks

    run = lease.Lease(tmp_path / "out", tmp_path / "work", 600, False, lease.PHASES)
    run.box_left = 100
    parsers = {"bench.gpu.model_state_gpu": model_state_gpu.parser(), "bench.gpu.alloc_ratio": alloc_ratio.parser()}
    checked = 0
    for ph in lease.PHASES:
        argv = ph.argv(run)
        if argv[1:2] == ["-m"] and argv[2] in parsers:
            args = parsers[argv[2]].parse_args(argv[3:])  # exits (a failure here) on a flag it does not take
            if argv[2] == "bench.gpu.model_state_gpu":
                assert args.fp32_masters, argv  # model state runs in the format users train in
            checked += 1
    assert checked == 3  # model state, its late-copies run, the allocators
    assert set(lease.QUICK_REST) <= {c.name for c in quick_checks.CHECKS}
    assert {"adapter", "resnet_vmalloc_swap"}.isdisjoint(lease.QUICK_REST)  # run by earlier phases
    # The failure tests' ids: the smoke run's failures phase runs them (pytest fails on an id it cannot find).


def test_the_phases_expected_seconds_fit_the_lease():
    """Note [The lease's time]: what each phase took on the first lease (or is estimated to take) adds up to less
    than the run's time less what is kept for the summary; a phase added or grown past that says so here."""
    assert all(ph.expect > 0 or ph.name == "adapter" for ph in lease.PHASES)  # the adapter compiles in the background
    assert all(ph.expect <= ph.box for ph in lease.PHASES)
    assert sum(ph.expect for ph in lease.PHASES) <= lease.SECONDS - lease.RESERVE
    names = [ph.name for ph in lease.PHASES]
    assert names.index("adapter") < min(names.index("failures"), names.index("quick"))  # they need the adapter


def test_allocator_ratios_are_to_the_first_native_run_and_the_repeat_shows_drift():
    from bench.gpu import alloc_ratio

    rows = [{"model": "gpt2", "allocator": a, "throughput": t, "unit": "tokens/s"}
            for a, t in [("native", 100.0), ("vmalloc", 98.0), ("native", 101.0)]]  # fmt: skip
    rows.append({"model": "gpt2", "allocator": "expandable", "skipped": True, "status": "skipped: no CUDA"})
    r = alloc_ratio.ratios(rows)
    assert r == {"gpt2": {"native": 1.0, "vmalloc": 0.98, "native_repeat": 1.01}}
    fig = alloc_ratio.figure({"rows": rows, "ratio_to_native": r})
    assert fig == "gpt2: native 100 tokens/s, vmalloc 0.980x, native_repeat 1.010x; skipped: expandable (no CUDA)"
