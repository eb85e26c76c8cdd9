"""The loops people write, on Hugging Face architectures (tiny configurations built in code, nothing downloaded),
under ``SwapManager(model=, optimizer=)`` with the default strategy: bitwise plain training, every iteration within
the budget as an independent LiveBytesMeter sees it (issue 36, delivery item 2; a start: more architectures and
loop variants to come)."""

import functools

import pytest
import torch
from ms_loops import assert_same, run, within

import swap

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 256, 16


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))  # fmt: skip


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ))  # fmt: skip


def vit():
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))  # fmt: skip


def loss_of(model, it):
    g = torch.Generator().manual_seed(it)
    if isinstance(model, transformers.ViTForImageClassification):
        return model(pixel_values=torch.randn(8, 3, 16, 16, generator=g),
                     labels=torch.randint(0, 10, (8,), generator=g)).loss  # fmt: skip
    ids = torch.randint(0, VOCAB, (8, SEQ), generator=g)
    return model(input_ids=ids, labels=ids).loss


def accumulate_clip_schedule(model, opt, it, log):
    """Two micro-batches, clip_grad_norm_, an LR scheduler (made at the first step, stored on the optimizer)."""
    sched = opt.__dict__.setdefault("_test_sched", torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.8))
    opt.zero_grad()
    for micro in range(2):
        loss = loss_of(model, it * 10 + micro)
        (loss / 2).backward()
        log["loss"].append(loss.item())
    log.setdefault("norm", []).append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
    opt.step()
    sched.step()


def zeros_bf16(model, opt, it, log):
    """``zero_grad(set_to_none=False)`` and a bf16 autocast forward."""
    opt.zero_grad(set_to_none=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_of(model, it)
    loss.backward()
    log["loss"].append(loss.item())
    opt.step()


MODELS = {"gpt2": gpt2, "llama": llama, "vit": vit}
LOOPS = {"accumulate_clip_schedule": accumulate_clip_schedule, "zeros_bf16": zeros_bf16}


@functools.cache
def plain(model, loop):
    meter = swap.LiveBytesMeter("cpu")
    return run(MODELS[model], LOOPS[loop], iters=5, meter=meter), meter.peak


@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_loop_bitwise_within_the_budget(model, loop):
    ref, peak = plain(model, loop)
    budget = int(0.7 * peak)

    def manager(m, opt):
        return swap.SwapManager(budget=budget, device="cpu", model=m, optimizer=opt, bucket_bytes="64KiB",
                                min_bytes="4KiB")  # fmt: skip

    got = run(MODELS[model], LOOPS[loop], iters=5, manager=manager, meter=swap.LiveBytesMeter("cpu"))
    assert_same(ref, got)
    within(got, budget)
