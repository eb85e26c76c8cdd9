"""Frozen parameters (Note [Frozen parameters] in swap/runtime/model_state/buckets.py): an optimizer over
``model.parameters()`` after freezing layers trains as in plain torch, and weights that need no gradient are model
state like the others, moved off the device whether or not the optimizer lists them: LoRA trains on a base model
whose frozen weights alone exceed the budget."""

import functools
import io

import torch
from ms_loops import assert_same, gpt, plain_step, run, within

import swap


def default(budget="64MiB"):
    def make(model, opt):
        return swap.SwapManager(budget=budget, device="cpu", model=model, optimizer=opt, bucket_bytes="64KiB",
                                min_bytes="4KiB")  # fmt: skip

    return make


def freeze_half(model):
    """The usual fine-tuning pattern: the embeddings and the first block frozen."""
    for name, p in model.named_parameters():
        if name.startswith(("tok.", "pos.", "blocks.0.")):
            p.requires_grad_(False)


def all_params(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)


def test_frozen_parameters_passed_to_the_optimizer_train_as_in_torch():
    """``AdamW(model.parameters())`` after freezing: torch skips the frozen ones (no gradient, no state)."""
    ref = run(gpt, plain_step, make_opt=all_params, prepare=freeze_half)
    got = run(gpt, plain_step, make_opt=all_params, prepare=freeze_half, manager=default())
    assert_same(ref, got)
    assert any(g is None for g in got["grads"]) and len(got["state"]["state"]) < len(got["params"])
    ms = got["manager"].report()["model_state"]
    frozen = sum(p.numel() * 4 for n, p in gpt().named_parameters() if n.startswith(("tok.", "pos.", "blocks.0.")))
    trainable = sum(p.numel() * 4 for p in gpt().parameters()) - frozen
    assert ms["host_bytes_predicted"] < 4 * (frozen + trainable) + trainable  # no buffer or state for the frozen


class LoRALinear(torch.nn.Module):
    """A frozen ``base`` plus a trainable low-rank update, as PEFT's LoRA makes it."""

    def __init__(self, base: torch.nn.Linear, r: int = 4) -> None:
        super().__init__()
        self.base = base
        self.lora_a = torch.nn.Linear(base.in_features, r, bias=False)
        self.lora_b = torch.nn.Linear(r, base.out_features, bias=False)
        torch.nn.init.normal_(self.lora_b.weight, std=0.02)  # PEFT zeroes it; nonzero makes every step count

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


def lora_gpt():
    model = gpt(n_layer=2, d_model=128)
    for p in model.parameters():
        p.requires_grad_(False)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and "lora" not in name:
                setattr(module, name, LoRALinear(child))
    return model


def adapters(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, foreach=False)


def base_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


@functools.cache
def plain_lora():
    meter = swap.LiveBytesMeter("cpu")
    return run(lora_gpt, plain_step, make_opt=adapters, meter=meter), meter.peak


def test_lora_on_a_base_larger_than_the_budget_trains():
    """The optimizer lists only the adapters; the frozen base, more than the budget by itself, is streamed."""
    ref, peak = plain_lora()
    base = base_bytes(lora_gpt())
    budget = int(0.8 * base)
    assert budget < peak
    got = run(lora_gpt, plain_step, make_opt=adapters, manager=default(budget), meter=swap.LiveBytesMeter("cpu"))
    assert_same(ref, got)
    within(got, budget)
    ms = got["manager"].report()["model_state"]
    assert ms["weights_in_bytes"] > base  # the base's weights came in, and left, every step
    assert ms["state_bytes"] + ms["host_bytes_predicted"] < 3 * base  # no gradient buffers or state for the base


def test_a_checkpoint_of_streamed_frozen_weights_saves_and_loads():
    """``model.state_dict()`` under the manager gives the frozen weights' host masters, not views of their dropped
    device storage (which torch.save wrote as 0 bytes and torch.load refused to resize)."""
    saved = {}

    def save_each_step(model, opt, it, log):
        plain_step(model, opt, it, log)
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        buf.seek(0)
        saved[len(saved)] = torch.load(buf)

    ref = run(gpt, save_each_step, iters=3, make_opt=all_params, prepare=freeze_half)
    plain_saved = dict(saved)
    saved.clear()
    got = run(gpt, save_each_step, iters=3, make_opt=all_params, prepare=freeze_half, manager=default())
    assert_same(ref, got)
    for step, sd in plain_saved.items():
        for k, v in sd.items():
            assert torch.equal(saved[step][k], v), f"step {step}: {k} differs"
