"""``p.grad`` of an offloaded parameter is its gradient, as in plain torch (Note [p.grad of an offloaded parameter]
in swap/runtime/model_state/gradients.py): reads between backward and step (grad-norm logging, NaN checks),
``clip_grad_value_``, in-place and whole writes, and zeroing by hand (``p.grad = None``), bitwise plain torch."""

import torch
from ms_loops import assert_same, batch, gpt, loss_of, run

import swap

STREAMED_64K = swap.ModelStatePolicy(placement="streamed", bucket_bytes="64KiB")


def offload(model, opt):
    return swap.SwapManager(budget="64MiB", device="cpu", model=model, optimizer=opt, model_state=STREAMED_64K,
                            min_bytes="4KiB")  # fmt: skip


def logging_step(model, opt, it, log):
    """Logs the gradient norm and a NaN check over ``p.grad``, clips by value, scales one gradient in place and
    replaces another, then steps."""
    opt.zero_grad()
    x, y = batch(it)
    loss = loss_of(model, x, y)
    loss.backward()
    log["loss"].append(loss.item())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    log.setdefault("count", []).append(len(grads))
    log.setdefault("norm", []).append(torch.stack([g.norm() for g in grads]).norm().item())
    log.setdefault("nan", []).append(any(bool(g.isnan().any()) for g in grads))
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    head = model.head.weight
    head.grad.mul_(0.5)
    model.ln.weight.grad = model.ln.weight.grad * 2.0
    log.setdefault("head_grad_sum", []).append(head.grad.sum().item())
    opt.step()


def by_hand_step(model, opt, it, log):
    """Two micro-batches accumulated, and the gradients zeroed by hand (``p.grad = None``) instead of zero_grad."""
    for p in model.parameters():
        p.grad = None
    for micro in range(2):
        x, y = batch(it * 10 + micro)
        loss = loss_of(model, x, y)
        (loss / 2).backward()
        log["loss"].append(loss.item())
    opt.step()


def test_reads_and_writes_of_p_grad_between_backward_and_step():
    got = run(gpt, logging_step, iters=4, manager=offload)
    assert_same(run(gpt, logging_step, iters=4), got)
    assert got["log"]["norm"][0] > 0 and got["log"]["count"][0] == len(got["params"])


def test_p_grad_none_by_hand_starts_the_next_step_afresh():
    got = run(gpt, by_hand_step, iters=4, manager=offload)
    assert_same(run(gpt, by_hand_step, iters=4), got)
