"""Checkpointed models capture as they train: Hugging Face's gradient_checkpointing_enable() (reentrant and
not) on GPT-2, a Llama-style model and BERT; torch.utils.checkpoint with and without context_fn;
checkpoint_sequential. The recompute takes the forward's kernels and is recorded as "recompute"; what cannot
be captured still says so clearly."""

import functools

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)

from swap.capture import OP, PHASE, SAVE, CaptureError, Trace, capture

transformers = pytest.importorskip("transformers")
VOCAB, TOKENS = 128, 32


def hf_models():
    small = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    return {
        "gpt2": lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=VOCAB)),
        "llama": lambda: transformers.LlamaForCausalLM(
            transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_key_value_heads=2, **small)),
        "bert": lambda: transformers.BertForMaskedLM(
            transformers.BertConfig(hidden_size=64, intermediate_size=128, **small)),
    }  # fmt: skip


def tokens(n: int) -> dict:
    ids = torch.randint(0, VOCAB, (n, TOKENS))
    return {"input_ids": ids, "labels": ids}


def checkpointed(build, reentrant):
    def model_fn():
        model = build()
        if reentrant is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return model

    return model_fn


def phase_ops(t: Trace, phase: str) -> np.ndarray:
    b, e = t.iterations()[-1]
    k = np.arange(b, e + 1)
    return k[(t.op[k] == OP) & (t.phase[k] == PHASE[phase])]


def saved_bytes(t: Trace) -> int:
    """Bytes saved for the backward in the forward (a reentrant recompute saves again, for its own backward)."""
    b, _ = t.iterations()[-1]
    end = phase_ops(t, "backward")[0]
    return int(t.size[b:end][t.op[b:end] == SAVE].sum())


@functools.cache
def hf_capture(name: str, reentrant):
    return capture(checkpointed(hf_models()[name], reentrant), tokens, 2)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_hugging_face_gradient_checkpointing(name, reentrant):
    plain, ck = hf_capture(name, None), hf_capture(name, reentrant)
    assert len(phase_ops(plain, "recompute")) == 0
    recompute = phase_ops(ck, "recompute")
    assert len(recompute) > 0
    names = {ck.op_name(k) for k in recompute}
    # The recompute takes the forward's attention kernel (memory-efficient attention on the CUDA target), not
    # the meta device's math path: otherwise non-reentrant checkpointing refuses (saved tensors differ).
    attention = {n for n in names if "attention" in n}
    assert attention == {"aten._scaled_dot_product_efficient_attention.default"}
    assert attention <= {plain.op_name(k) for k in phase_ops(plain, "forward")}
    # Recomputed operators belong to the layers' modules (Hugging Face checkpoints each layer's forward).
    modules = {ck.module_name(k) for k in recompute}
    assert None not in modules and all(".layer" in m or ".h." in m for m in modules)
    # Each layer's forward runs again: its matmul FLOPs, about one forward of the layers, are added.
    layer_flops = sum(plain.flops[k] for k in phase_ops(plain, "forward") if ".layer" in str(plain.module_name(k))
                      or ".h." in str(plain.module_name(k)))  # fmt: skip
    assert 0.6 * layer_flops <= ck.flops[recompute].sum() <= 1.01 * layer_flops
    # What checkpointing is for: the layers' activations are not saved.
    assert saved_bytes(ck) < 0.6 * saved_bytes(plain)


class Blocks(nn.Module):
    """Four MLP blocks with residuals, optionally checkpointed (torch.utils.checkpoint or checkpoint_sequential)."""

    def __init__(self, how: str = "none", d: int = 32) -> None:
        super().__init__()
        self.how = how
        self.embed = nn.Linear(d, d)  # reentrant checkpointing needs an input that requires grad
        self.blocks = nn.Sequential(*(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                                    nn.Linear(4 * d, d)) for _ in range(4)))  # fmt: skip
        self.head = nn.Linear(d, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        if self.how == "sequential":
            x = checkpoint_sequential(self.blocks, 2, x, use_reentrant=False)
        else:
            for block in self.blocks:
                if self.how == "none":
                    x = x + block(x)
                elif self.how == "selective":  # keep the matmuls' outputs, recompute the rest
                    x = x + checkpoint(block, x, use_reentrant=False, context_fn=_keep_matmuls)
                else:
                    x = x + checkpoint(block, x, use_reentrant=self.how == "reentrant")
        return self.head(x.mean(1))


def _keep_matmuls():
    def policy(ctx, op, *args, **kwargs):
        keep = op in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def seq_batch(n: int):
    return torch.randn(n, 16, 32), torch.randint(0, 5, (n,))


@functools.cache
def blocks_capture(how: str) -> Trace:
    return capture(lambda: Blocks(how), seq_batch, 8)


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant", "selective", "sequential"])
def test_torch_utils_checkpoint(how):
    plain, ck = blocks_capture("none"), blocks_capture(how)
    recompute = phase_ops(ck, "recompute")
    names = [ck.op_name(k) for k in recompute]
    assert names and all(ck.module_name(k) is not None for k in recompute)
    if how == "selective":  # the kept matmuls are not run again; the rest of the blocks is
        assert "aten.addmm.default" not in names and "aten.gelu.default" in names
    else:  # a non-reentrant recompute stops after the last tensor the backward needs (a block's 2nd matmul)
        assert names.count("aten.addmm.default") >= (3 if how == "sequential" else 4)
    assert saved_bytes(ck) < saved_bytes(plain)
    # The backward itself is the same work: the checkpoints add the recompute and nothing else.
    assert ck.flops[phase_ops(ck, "backward")].sum() == pytest.approx(plain.flops[phase_ops(plain, "backward")].sum())


class ReadsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return y * 2 if y.max() > 0 else y  # a value the meta device does not have


class CheckpointsValueReads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = ReadsValues()
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.inner, x, use_reentrant=False).mean(1))


def test_what_cannot_be_captured_still_says_so_inside_a_checkpoint():
    with pytest.raises(CaptureError) as e:
        capture(CheckpointsValueReads, seq_batch, 4)
    assert e.value.module == "module `inner` (ReadsValues)" and e.value.phase == "forward and loss"
    assert "_local_scalar_dense" in e.value.op and "What to do" in str(e.value)
    # A padded batch makes Hugging Face read the attention mask's values: named, with the advice.
    with pytest.raises(CaptureError, match="attention_mask"):
        capture(checkpointed(hf_models()["llama"], False),
                lambda n: dict(tokens(n), attention_mask=torch.ones(n, TOKENS, dtype=torch.long)), 2)  # fmt: skip
