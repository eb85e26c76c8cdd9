"""Where the meta device and the device's kernels differ, a capture runs what the device runs: meta kernels
narrower than the device's (mixture-of-experts' grouped matmul in fp32), the CPU's choice of attention kernel
(a mask that requires grad takes the math path). Where a capture still cannot run a step that runs for real,
its error says that the capture has reached its limit, not that the model is wrong."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from swap.capture import OP, PHASE, SAVE, CaptureError, capture


def _mixtral():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)  # fmt: skip
    return lambda: transformers.MixtralForCausalLM(cfg)


def tokens(n):
    ids = torch.randint(0, 64, (n, 16))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_fp32_mixtral_captures_where_it_trains(target):
    model_fn = _mixtral()
    model_fn()(**tokens(2)).loss.backward()  # the real step runs in fp32 (the CPU's grouped matmul)
    t = capture(model_fn, tokens, 2, target=target)
    grouped = (t.op == OP) & (t.id == t.meta["ops"].index("aten._grouped_mm.default"))
    b, e = t.iterations()[-1]
    forward = grouped[b:e] & (t.phase[b:e] == PHASE["forward"])
    # Per layer: gate and up (64 routed rows x 32 -> 128), then down (64 x 64 -> 32); 2 x rows x in x out FLOPs.
    rows = 2 * 16 * 2  # tokens x experts per token
    assert sorted(t.flops[b:e][forward].tolist()) == sorted([2.0 * rows * 32 * 128, 2.0 * rows * 64 * 32] * 2)
    assert (grouped[b:e] & (t.phase[b:e] == PHASE["backward"])).sum() == 2 * forward.sum()  # dX and dW each
    # PyTorch's own meta kernel is back once the capture ends.
    a, w = torch.empty(8, 16, device="meta"), torch.empty(4, 16, 32, device="meta")
    with pytest.raises(RuntimeError, match="BF16"):
        torch._grouped_mm(a, w, offs=torch.empty(4, dtype=torch.int32, device="meta"))


class BiasedAttention(nn.Module):
    """Attention with a learned additive bias as its mask (as Swin's relative position bias is): the mask
    requires grad."""

    def __init__(self, learned: bool = True, shape: tuple = (1, 4, 16, 16), d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.bias = nn.Parameter(torch.zeros(shape), requires_grad=learned)
        self.out = nn.Linear(d, 7)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, 2))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def biased_batch(n):
    return torch.randn(n, 16, 32), torch.randint(0, 7, (n, 16))


def real_saves(model, batch):
    """Bytes of every tensor a real CPU step saves for its backward."""
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    x, y = batch
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(x).reshape(-1, 7), y.reshape(-1)).backward()
    return sizes


@pytest.mark.parametrize(
    "learned, shape, flash",
    [(True, (1, 4, 16, 16), False),  # a mask that requires grad: the math path (flash cannot differentiate it)
     (False, (1, 4, 16, 16), True),  # a fixed one: the CPU's flash kernel
     (False, (4, 16, 16), False)],  # a 3-D mask: the math path (the CPU's flash kernel takes 2-D or 4-D masks)
)  # fmt: skip
def test_the_cpu_capture_takes_the_attention_kernel_the_cpu_runs(learned, shape, flash):
    scores = 2 * 4 * 16 * 16 * 4  # batch 2, 4 heads, 16 x 16 attention weights, fp32: the math path saves them
    real = real_saves(BiasedAttention(learned, shape), biased_batch(2))
    t = capture(lambda: BiasedAttention(learned, shape), biased_batch, 2, target="cpu")
    captured = t.size[t.op == SAVE].tolist()
    assert (scores in real) == (not flash)
    assert (scores in captured) == (not flash)
    assert ("aten._scaled_dot_product_flash_attention_for_cpu.default" in t.meta["ops"]) == flash


def test_swin_captures_for_the_cpu():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                  window_size=4, num_labels=5)  # fmt: skip

    def images(n):
        return {"pixel_values": torch.randn(n, 3, 32, 32), "labels": torch.randint(0, 5, (n,))}

    transformers.SwinForImageClassification(cfg)(**images(2)).loss.backward()  # the real CPU step runs
    t = capture(lambda: transformers.SwinForImageClassification(cfg), images, 2, target="cpu")
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" not in t.meta["ops"]
    assert (t.op == SAVE).sum() > 0


@torch.library.custom_op("swap_capture_limits::bf16_only_fake", mutates_args=())
def scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


scaled.register_autograd(lambda ctx, grad: grad * 2)


@scaled.register_fake
def _(x):
    if x.dtype != torch.bfloat16:  # narrower than the CPU kernel above, as PyTorch's grouped matmul's is
        raise RuntimeError(f"expected bf16 inputs, got {x.dtype}")
    return torch.empty_like(x)


class Scaled(nn.Module):
    def forward(self, x):
        return scaled(x)


class Mismatched(nn.Module):
    def forward(self, x):
        return x @ torch.ones(3, 8)  # x has 8 features: wrong on any device


def vectors(n):
    return torch.randn(n, 8), torch.randint(0, 4, (n,))


def tiny(block):
    return lambda: nn.Sequential(nn.Linear(8, 8), block(), nn.Linear(8, 4))


def test_a_refusal_says_whether_the_capture_or_the_model_is_at_fault():
    tiny(Scaled)()(vectors(2)[0]).sum().backward()  # it runs for real
    with pytest.raises(CaptureError) as e:
        capture(tiny(Scaled), vectors, 2)
    assert "the capture has reached its limit, not the model" in str(e.value)
    assert "swap_capture_limits.bf16_only_fake" in e.value.op
    with pytest.raises(CaptureError) as e:
        capture(tiny(Mismatched), vectors, 2)
    assert "the model's own" in str(e.value) and "reached its limit" not in str(e.value)
