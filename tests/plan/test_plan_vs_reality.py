"""The planner's predicted peaks against real CPU training of a third-party model (Hugging Face GPT-2, tiny),
measured by an independent LiveBytesMeter: without swapping, and under SwapManager with a budget (the full
comparison, three models, is bench/plan_vs_reality.py with committed results)."""

import pytest
import torch

from bench import plan_vs_reality

transformers = pytest.importorskip("transformers")


def tiny_gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=512)

    def batch_fn(n):
        ids = torch.randint(0, 512, (n, 64))
        return {"input_ids": ids, "labels": ids}

    return {"name": "gpt2 tiny", "model_fn": lambda: transformers.GPT2LMHeadModel(cfg), "batch_fn": batch_fn,
            "loss_fn": None, "batch": 4, "config": "2 layers, 64 wide, 64 tokens"}  # fmt: skip


def test_predicted_peaks_match_a_cpu_run_within_5_percent(monkeypatch):
    monkeypatch.setattr(plan_vs_reality, "MIN_BYTES", 16 * 1024)
    row = plan_vs_reality.evaluate(tiny_gpt2())
    assert row["predicted_no_swap_peak"] > row["budget"] > row["floor"]  # the budget makes the runtime swap
    assert abs(row["no_swap_error"]) <= 0.05, row
    assert abs(row["error_under_budget_planned"]) <= 0.05, row
    assert row["measured_peak_under_budget_planned"] <= row["budget"]
    assert row["runtime_swapped_out_bytes"] > 0 and not row["runtime_declined"] and row["losses_equal"]
