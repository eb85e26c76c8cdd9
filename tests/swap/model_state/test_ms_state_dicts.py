"""``model.state_dict()`` and ``opt.state_dict()`` inside the manager are plain torch's, and a run resumes from
them with or without the manager, bitwise as if it had never stopped."""

import functools
import io

import torch
from ms_training import assert_bitwise, assert_same_state, same_bits, state_arrays, train

import swap

STREAMED_64K = swap.ModelStatePolicy(placement="streamed", bucket_bytes="64KiB")

SPLIT = 2  # steps before the checkpoint; as many after


def offload(model, opt):
    return swap.SwapManager(budget="1GiB", device="cpu", policy="window", model=model, optimizer=opt,
                            model_state=STREAMED_64K)  # fmt: skip


@functools.cache
def plain_through():
    """Plain training for 2 * SPLIT steps, with its state dicts after SPLIT steps."""
    saved = {}

    def keep(step, model, opt, sched):
        if step == SPLIT - 1:
            saved["model"] = {k: v.numpy().copy() for k, v in model.state_dict().items()}
            saved["opt"] = state_arrays(opt.state_dict())

    return train(steps=2 * SPLIT, step_hook=keep), saved


def checkpoint(model, opt, sched) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    return buf.getvalue()


def restore(data: bytes):
    def load(model, opt, sched):
        ck = torch.load(io.BytesIO(data), weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])

    return load


def tail(result):
    """The second half of a run's record, to compare with a resumed run's."""
    per_step = len(result["losses"]) // (2 * SPLIT)
    return {**result, "losses": result["losses"][SPLIT * per_step :], "norms": result["norms"][SPLIT:]}


def test_state_dicts_inside_are_plain_torchs():
    ref, saved = plain_through()
    got = {}

    def keep(step, model, opt, sched):
        if step == SPLIT - 1:
            got["model"] = {k: v.numpy().copy() for k, v in model.state_dict().items()}
            got["opt"] = state_arrays(opt.state_dict())

    train(steps=SPLIT, manager=offload, step_hook=keep)
    assert list(got["model"]) == list(saved["model"])
    for k, v in saved["model"].items():
        assert same_bits(v, got["model"][k]), f"model.state_dict()[{k!r}] differs"
    assert_same_state(saved["opt"], got["opt"])


def first_half_checkpoint(manager=None) -> bytes:
    """The checkpoint (model, optimizer, scheduler) after the first SPLIT steps, trained with ``manager``."""
    data = {}

    def save(step, model, opt, sched):
        if step == SPLIT - 1:
            data["ck"] = checkpoint(model, opt, sched)

    train(steps=SPLIT, manager=manager, step_hook=save)
    return data["ck"]


def test_saved_with_the_manager_resumes_without_it():
    ref, _ = plain_through()
    resumed = train(steps=SPLIT, first_step=SPLIT, inside=restore(first_half_checkpoint(offload)))
    assert_bitwise(tail(ref), resumed)


def test_saved_without_the_manager_resumes_with_it():
    ref, _ = plain_through()
    resumed = train(steps=SPLIT, first_step=SPLIT, inside=restore(first_half_checkpoint()), manager=offload)
    assert_bitwise(tail(ref), resumed)
    r = resumed["manager"].report()["model_state"]
    assert r["weights_out_bytes"] > 0  # the loaded weights were written on the device and copied back


def test_entering_mid_run_takes_the_optimizer_state_over():
    """A manager entered mid-run (the optimizer has state already) moves that state to the host and gives it back
    at its exit: the run goes on bitwise."""
    ref, _ = plain_through()
    holder = {}

    def first_half(step, model, opt, sched):
        holder["run"] = (model, opt, sched)

    train(steps=SPLIT, step_hook=first_half)
    model, opt, sched = holder["run"]

    resumed = train(lambda: model, lambda m: opt, steps=SPLIT, first_step=SPLIT, manager=offload,
                    inside=lambda m, o, s: s.load_state_dict(sched.state_dict()))  # fmt: skip
    assert_bitwise(tail(ref), resumed)
