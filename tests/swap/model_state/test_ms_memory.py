"""Model state under the budget: a GPT-style model whose parameters, gradients and AdamW state alone exceed the
budget (30% of the plain run's peak) trains bitwise with every iteration, the two profiling ones included, within
the budget as an independent LiveBytesMeter sees it; host memory is what was predicted before it was allocated,
page-locked exactly where pinning works, pageable with a warning where it does not."""

import functools

import pytest
from ms_training import TiedGPT, assert_bitwise, gpt, train

import swap
from swap.runtime.machine.host_pool import PinningUnavailable

STREAMED_64K = swap.ModelStatePolicy(placement="streamed", bucket_bytes="64KiB")

MODEL = functools.partial(gpt, n_layer=2, d_model=64)


@functools.cache
def plain():
    meter = swap.LiveBytesMeter("cpu")
    return train(MODEL, meter=meter), meter.peak


def offload(budget, pinner=None):
    def make(model, opt):
        sm = swap.SwapManager(budget=budget, device="cpu", model=model, optimizer=opt, model_state=STREAMED_64K,
                              min_bytes="4KiB")  # fmt: skip
        sm.model_state.pinner = pinner
        return sm

    return make


def test_model_state_alone_over_the_budget_trains_within_it():
    ref, peak = plain()
    budget = int(0.3 * peak)
    n = sum(p.numel() for p in MODEL().parameters())
    assert 16 * n > budget, "parameters, gradients and AdamW's two moments alone must exceed the budget"
    got = train(MODEL, meter=swap.LiveBytesMeter("cpu"), manager=offload(budget))
    assert_bitwise(ref, got)
    over = [(i, p - budget) for i, p in enumerate(got["peaks"]) if p > budget]
    assert not over, f"iterations over the budget of {budget} bytes: {over}; peaks {got['peaks']}"
    r = got["manager"].report()
    assert r["peak_device_bytes"] <= budget and r["overruns"] == 0
    ms = r["model_state"]
    assert ms["weights_in_bytes"] > 4 * n * 3  # every step brought the weights in again
    assert ms["host_bytes"] == ms["host_bytes_predicted"]  # predicted before anything was allocated


class Pinner:
    def __init__(self, fail: bool = False):
        self.fail = fail
        self.pinned: dict[int, int] = {}

    def pin(self, addr, nbytes):
        if self.fail:
            raise RuntimeError("cuMemHostRegister failed: CUDA_ERROR_NOT_PERMITTED")
        self.pinned[addr] = nbytes

    def unpin(self, addr):
        del self.pinned[addr]


def test_pinned_bytes_are_exactly_the_prediction():
    ref, peak = plain()
    pinner = Pinner()
    got = train(MODEL, manager=offload(int(0.3 * peak), pinner))
    assert_bitwise(ref, got)
    ms = got["manager"].report()["model_state"]
    assert ms["pinned_bytes"] == ms["pinned_bytes_predicted"] > 0
    assert ms["pinned_bytes"] == ms["host_bytes"] - ms["state_bytes"]  # masters, gradients, staging: no rounding
    assert pinner.pinned == {}  # all unpinned at the manager's exit


def test_pageable_fallback_warns_and_trains_the_same():
    ref, peak = plain()
    with pytest.warns(PinningUnavailable, match="CUDA_ERROR_NOT_PERMITTED"):
        got = train(MODEL, manager=offload(int(0.3 * peak), Pinner(fail=True)))
    assert_bitwise(ref, got)
    assert got["manager"].report()["model_state"]["pinned_bytes"] == 0


def test_weights_are_clean_variables_the_window_prefetches():
    """Each streamed bucket is a clean variable of the plan (Note [Clean variables at run time]): the window
    fetches it ahead of its uses, forward and backward, and drops it with no copy out."""
    ref, peak = plain()
    budget = int(0.3 * peak)
    got = train(MODEL, meter=swap.LiveBytesMeter("cpu"),
                manager=lambda m, o: swap.SwapManager(budget=budget, device="cpu", model=m, optimizer=o,
                                                      policy="window", model_state=STREAMED_64K,
                                                      min_bytes="4KiB"))  # fmt: skip
    assert_bitwise(ref, got)
    assert max(got["peaks"]) <= budget
    sm = got["manager"]
    seq = sm.sequence
    clean = {v for v, c in enumerate(seq.clean) if c}
    assert len(clean) == sm.report()["model_state"]["buckets"]
    uses = [i for i, v in enumerate(seq.var) if v in clean]
    assert len(uses) >= 2 * len(clean)  # read in the forward and again in the backward
    # The last iteration (the one the manager exited in) is a second micro-batch: no host update was pending,
    # so the plan was followed as made. (After an optimizer step a prefetch may wait for nothing: a bucket whose
    # host update still runs is fetched at its use instead.)
    actions = sm.executor.actions
    prefetched = {v for _, a, v in actions if a == "swap_in" and v in clean}
    assert len(prefetched) >= len(clean) // 2, actions
    assert not [v for _, a, v in actions if a == "demand" and v in clean]
    assert not [v for _, a, v in actions if a == "swap_out" and v in clean]  # dropped clean: no copy out


def test_a_read_outside_its_module_becomes_a_planned_use():
    """The tied embedding the root reads as its output projection: a demand fetch in the first pass only; from
    the next one it is a use at the hook event the read followed, scheduled with the rest, and the run keeps the
    budget from its first planned iteration on."""
    meter = swap.LiveBytesMeter("cpu")
    ref = train(TiedGPT, meter=meter)
    budget = int(0.3 * meter.peak)
    got = train(TiedGPT, meter=swap.LiveBytesMeter("cpu"),
                manager=lambda m, o: swap.SwapManager(budget=budget, device="cpu", model=m, optimizer=o,
                                                      policy="window", model_state=STREAMED_64K,
                                                      min_bytes="4KiB"))  # fmt: skip
    assert_bitwise(ref, got)
    assert max(got["peaks"]) <= budget, got["peaks"]
    r = got["manager"].report()
    assert r["model_state"]["demand_fetches"] == 1 and r["overruns"] == 0
