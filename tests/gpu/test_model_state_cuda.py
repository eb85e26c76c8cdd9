"""Model state on CUDA (``SwapManager(model=, optimizer=)``): a 200M Llama under a budget below its weights + AdamW
state, bitwise against the oracle (the same training with torch's AdamW run on host copies), with every copy of
the swap engine made late (Note [Late copies] in bench/gpu/lag.py): a missing device-side wait would show here.
bench/gpu/model_state_gpu.py runs it, in a process of its own."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_model_state_under_late_copies_is_bitwise_and_within_budget(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.gpu.model_state_gpu", "--size", "200m", "--lag", "--runs", "ours",
                        "reference", "sgd_exit", "--steps", "3", "--warmup", "1", "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    res = json.loads((tmp_path / "model_state_gpu.json").read_text())
    assert "cycles before every copy" in res["lag"]
    ours = res["runs"]["ours"]
    assert "error" not in ours and "error" not in res["runs"]["reference"], r.stderr[-4000:]
    assert res["compare"]["ours_vs_reference_bitwise"] == {"losses": True, "params_sha256": True,
                                                           "state_sha256": True}  # fmt: skip
    assert ours["within_budget"], ours["report"]
    assert res["compare"]["sgd_exit_bitwise"] == {"losses": True, "params_sha256": True}  # review row 6
    assert ours["budget_bytes"] < ours["weights_and_adamw_state_bytes"]
