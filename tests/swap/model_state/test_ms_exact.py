"""Training with the model state offloaded (every bucket streamed through the device, the host stepping it after
``opt.step()`` confirms) is bitwise plain torch on CPU: losses, clip norms, parameters, gradients and optimizer
state, with param groups, an LR scheduler, 2-step gradient accumulation and clipping."""

import functools

import pytest
from ms_training import OPTIMIZERS, TiedGPT, assert_bitwise, gpt, train

import swap
from swap.runtime.model_state.gradients import raw_grad

STREAMED_64K = swap.ModelStatePolicy(placement="streamed", bucket_bytes="64KiB")


def offload(model, opt, **kw):
    return swap.SwapManager(budget="1GiB", device="cpu", policy="window", model=model, optimizer=opt,
                            model_state=STREAMED_64K, **kw)  # fmt: skip


@functools.cache
def plain(optimizer="adamw", clip="torch", zero="none", tied=False):
    return train(TiedGPT if tied else gpt, optimizer, clip=clip if clip != "sm" else "torch",
                 zero=zero)  # fmt: skip


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_bitwise_plain_torch(optimizer):
    got = train(optimizer=optimizer, manager=offload)
    assert_bitwise(plain(optimizer), got)
    r = got["manager"].report()["model_state"]
    assert r["buckets"] > 1 and r["placements"] == {"streamed": r["buckets"]}
    assert r["weights_in_bytes"] > 0 and r["grads_out_bytes"] > 0  # the weights really left the device
    assert len(r["steps"]) == 3


def test_sm_clip_grad_norm_is_torchs():
    assert_bitwise(plain(), train(clip="sm", manager=offload))


@pytest.mark.parametrize("zero", ["zeros", "model", "never"])
def test_zero_grad_variants_match_torch(zero):
    """``set_to_none=False`` (the next backward adds to zeros), ``model.zero_grad()``, and no zero_grad at all
    (gradients accumulate across steps, as in torch)."""
    assert_bitwise(plain(zero=zero), train(zero=zero, manager=offload))


def test_tied_weights_and_reads_outside_their_module():
    """The token embedding is also the output projection, read by the root's forward: the parameter guard fetches
    it (a demand fetch the first time; later passes fetch it ahead of that read)."""
    got = train(TiedGPT, manager=offload)
    assert_bitwise(plain(tied=True), got)
    assert got["manager"].report()["model_state"]["demand_fetches"] > 0


def test_offloaded_parameters_keep_shape_and_identity_inside():
    seen = {}

    def look(step, model, opt, sched):
        p = model.head.weight
        seen["shape"], seen["nbytes"] = tuple(p.shape), p.untyped_storage().nbytes()
        seen["grad"], seen["torch_grad"] = p.grad, raw_grad(p)
        seen["same"] = opt.param_groups[0]["params"][-1] is p

    train(manager=offload, step_hook=look, steps=1)
    assert seen["shape"] == (256, 64) and seen["same"]
    assert seen["nbytes"] == 0  # dropped from the device between uses
    # The gradient is on the host: p.grad reads it there (Note [p.grad of an offloaded parameter]), and the
    # attribute torch keeps, which the user's optimizer reads, is None: it skips the parameter.
    assert seen["grad"] is not None and seen["grad"].shape == (256, 64) and seen["torch_grad"] is None
