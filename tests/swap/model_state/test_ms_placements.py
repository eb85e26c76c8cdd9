"""Buckets placed resident (stepped on the device by the user's optimizer), host master (a compute copy kept on the
device, the host stepping the master) and streamed, in one run: still bitwise plain torch, with the state of the
resident ones handed to the user's optimizer when the plan is applied (Note [Changing placements])."""

import functools

import torch
from ms_training import assert_bitwise, groups, train

import swap
from swap.runtime.model_state.gradients import raw_grad
from swap.schedule.model_state import ModelStatePlan, Placement, UpdateSite

STREAMED_64K = swap.ModelStatePolicy(placement="streamed", bucket_bytes="64KiB")


def mixed(n: int) -> ModelStatePlan:
    """The first third resident, the next third host masters, the rest streamed (forward order)."""
    third = n // 3
    placements = [Placement.RESIDENT] * third + [Placement.HOST_MASTER] * third
    placements += [Placement.STREAMED] * (n - len(placements))
    return ModelStatePlan(placements, [UpdateSite.DEVICE if p == Placement.RESIDENT else UpdateSite.HOST
                                       for p in placements])  # fmt: skip


def manager(model, opt):
    return swap.SwapManager(budget="1GiB", device="cpu", policy="window", model=model, optimizer=opt,
                            model_state=STREAMED_64K)  # fmt: skip


def propose_after_first_step(step, model, opt, sched, holder):
    if step == 0:
        ms = holder["sm"].model_state
        ms.propose(mixed(len(ms.streamer.buckets)))


def fused(model):
    """AdamW with fused=True, so that the resident buckets (the user's optimizer) and the host (Note [The host
    kernel]) step with the same kernel, as plain training with it does."""
    return torch.optim.AdamW(groups(model), lr=3e-3, weight_decay=0.1, fused=True)


@functools.cache
def plain():
    return train(optimizer=fused, steps=4)


def test_mixed_placements_are_bitwise_plain_torch():
    holder = {}

    def make(model, opt):
        holder["sm"] = manager(model, opt)
        return holder["sm"]

    got = train(optimizer=fused, steps=4, manager=make,
                step_hook=lambda *a: propose_after_first_step(*a, holder))  # fmt: skip
    assert_bitwise(plain(), got)
    ms = got["manager"].report()["model_state"]
    n = ms["buckets"]
    assert ms["placements"] == {"resident": n // 3, "host_master": n // 3, "streamed": n - 2 * (n // 3)}
    rows = ms["steps"]
    assert rows[0]["state_in_bytes"] == 0 and rows[1]["state_in_bytes"] > 0  # handed over at the second step
    assert rows[2]["state_in_bytes"] == 0
    assert rows[2]["weights_in_bytes"] < rows[0]["weights_in_bytes"]  # resident weights no longer move
    assert rows[2]["grads_out_bytes"] < rows[0]["grads_out_bytes"]  # nor their gradients


def test_resident_buckets_are_stepped_by_the_users_optimizer_on_the_device():
    holder, seen = {}, {}

    def make(model, opt):
        holder["sm"] = manager(model, opt)
        return holder["sm"]

    def look(step, model, opt, sched):
        propose_after_first_step(step, model, opt, sched, holder)
        if step == 2:
            ms = holder["sm"].model_state
            first = ms.entries[ms.streamer.buckets[0][0]].params[0][1]
            last = ms.entries[ms.streamer.buckets[-1][0]].params[0][1]
            seen["resident"] = (first.grad is not None, first in opt.state, first.untyped_storage().nbytes())
            # p.grad reads an offloaded gradient on the host; torch's attribute, which the optimizer reads, is None
            seen["streamed"] = (raw_grad(last) is None, last not in opt.state, last.untyped_storage().nbytes())

    train(steps=3, manager=make, step_hook=look)
    assert seen["resident"][:2] == (True, True) and seen["resident"][2] > 0
    assert seen["streamed"] == (True, True, 0)


def test_auto_makes_buckets_resident_where_the_budget_leaves_room():
    """model_state="auto": every bucket starts streamed; once the activations are planned (here: the run fits,
    the manager declines to swap them) the room left makes them resident, and the run stays bitwise."""
    got = train(optimizer=fused, steps=4, manager=lambda m, o: swap.SwapManager(
        budget="1GiB", device="cpu", policy="window", model=m, optimizer=o, bucket_bytes="64KiB"))  # fmt: skip
    assert_bitwise(plain(), got)
    report = got["manager"].report()
    ms = report["model_state"]
    assert ms["mode"] == "auto" and ms["placements"] == {"resident": ms["buckets"]}
    assert ms["steps"][-1]["weights_in_bytes"] == 0 and ms["steps"][-1]["grads_out_bytes"] == 0
    assert any(n.startswith("model state: auto:") for n in report["notes"])
