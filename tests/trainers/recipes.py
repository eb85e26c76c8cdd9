"""What the trainer recipes' tests share: a tiny Hugging Face GPT-2, its batches, and a budget that makes
the swap runtime swap (between the least any schedule needs and the peak without swapping)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

import swap

KiB = 1024
MIN_BYTES = 16 * KiB
SEQ, VOCAB = 64, 128


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=SEQ, vocab_size=VOCAB)
    return GPT2LMHeadModel(cfg)


def batch(n: int, seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def params(model: torch.nn.Module) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.parameters()]


def assert_bitwise_equal(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x, y), f"tensor {k} differs"


def budget_from_profile(train: Callable[[Any], Any], fraction: float = 0.5) -> int:
    """Runs ``train(manager)`` under a manager whose budget holds everything (it profiles, then declines), and
    returns a budget ``fraction`` of the way from the largest single step's working set to the peak without
    swapping."""
    probe = swap.SwapManager(budget="64GiB", device="cpu", min_bytes=MIN_BYTES)
    train(probe)
    seq = probe.sequence
    floor = seq.step_floor()
    peak = seq.no_swap_peak()
    assert floor < peak, "the test model must be able to swap"
    return floor + int((peak - floor) * fraction)


def manager(budget: int) -> swap.SwapManager:
    return swap.SwapManager(budget=budget, device="cpu", min_bytes=MIN_BYTES)


def assert_swapped_within(report: swap.SwapReport, budget: int) -> None:
    assert report["swapped_out_bytes"] > 0 and not report["declined"], dict(report)
    assert report["peak_device_bytes"] <= budget
