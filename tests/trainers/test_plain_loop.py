"""The plain-loop recipe: ``with swap.SwapManager(...)`` around the loop, here with a Hugging Face model."""

import contextlib

import torch
from recipes import assert_bitwise_equal, assert_swapped_within, batch, budget_from_profile, gpt2, manager, params


def train(sm=None, steps=4):
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    with sm if sm is not None else contextlib.nullcontext():
        for it in range(steps):
            loss = model(**batch(8, it)).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, params(model)


def test_plain_loop_is_bitwise_equal_and_swaps():
    budget = budget_from_profile(train)
    ref_losses, ref_params = train()
    sm = manager(budget)
    losses, got = train(sm)
    assert losses == ref_losses
    assert_bitwise_equal(ref_params, got)
    assert_swapped_within(sm.report(), budget)
