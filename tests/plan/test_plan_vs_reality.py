"""The planner's predicted peaks against real CPU training of a third-party model (Hugging Face GPT-2, tiny),
measured by an independent LiveBytesMeter: without swapping, and under SwapManager with a budget (the full
comparison, three models, is bench/plan_vs_reality.py with committed results).

On the CPU the "device" is the process's memory: the manager and the meter count every live CPU tensor, so
tensors that earlier tests left alive would count against the budget. The comparison therefore runs in a
fresh interpreter."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, torch, transformers
from bench import plan_vs_reality

plan_vs_reality.MIN_BYTES = 16 * 1024
cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=512)

def batch_fn(n):
    ids = torch.randint(0, 512, (n, 64))
    return {"input_ids": ids, "labels": ids}

spec = {"name": "gpt2 tiny", "model_fn": lambda: transformers.GPT2LMHeadModel(cfg), "batch_fn": batch_fn,
        "loss_fn": None, "batch": 4, "config": "2 layers, 64 wide, 64 tokens"}
print("ROW " + json.dumps(plan_vs_reality.evaluate(spec)))
"""


def test_predicted_peaks_match_a_cpu_run_within_5_percent():
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(next(line[4:] for line in r.stdout.splitlines() if line.startswith("ROW ")))
    assert row["predicted_no_swap_peak"] > row["budget"] > row["floor"]  # the budget makes the runtime swap
    assert abs(row["no_swap_error"]) <= 0.05, row
    assert abs(row["error_under_budget_planned"]) <= 0.05, row
    assert row["measured_peak_under_budget_planned"] <= row["budget"]
    assert row["runtime_swapped_out_bytes"] > 0 and not row["runtime_declined"] and row["losses_equal"]
