"""Capture of any model's training step on the meta device: the trace, Hugging Face models, the target's
kernels, scaling with the batch, and what it cannot capture."""

import pytest
import torch
from tiny_models import (
    Attention,
    Contrastive,
    TinyCNN,
    assert_balanced,
    attention_batch,
    cnn_batch,
    contrastive_batch,
    contrastive_loss,
)
from torch import nn

from swap import make_schedule
from swap.capture import (
    ALLOC,
    OP,
    PHASE,
    SAVE,
    TAGS,
    USE,
    CaptureError,
    LinearTrace,
    capture,
    default_loss,
    live_peak,
)
from swap.forecast.from_trace import sequence_from_trace, swapped


def test_a_training_step_is_balanced_and_tagged():
    t = capture(TinyCNN, cnn_batch, 4)
    assert len(t.iterations()) == 2 and t.meta["batch"] == 4 and t.meta["target"] == "cuda"
    alive = assert_balanced(t)
    assert {TAGS[k] for k in t.tag[t.op == ALLOC].tolist()} == set(TAGS)
    # After the run: weights (and BN buffers), their gradients, AdamW's two moments each, the last batch.
    params = list(TinyCNN().parameters())
    left = {TAGS[int(t.tag[(t.op == ALLOC) & (t.id == i)][0])]: 0 for i in alive}
    for i, s in alive.items():
        left[TAGS[int(t.tag[(t.op == ALLOC) & (t.id == i)][0])]] += s
    param_bytes = sum(p.numel() * 4 for p in params)
    assert left["grad"] == param_bytes and left["optimizer_state"] == 2 * param_bytes
    assert (t.op == SAVE).sum() == (t.op == USE).sum() > 0 and t.flops.sum() > 0


def test_hugging_face_models_with_their_labels():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=100)

    def batch(n):
        ids = torch.randint(0, 100, (n, 32))
        return {"input_ids": ids, "labels": ids}

    t = capture(lambda: transformers.GPT2LMHeadModel(cfg), batch, 3)
    assert t.meta["parameters"] == sum(p.numel() for p in transformers.GPT2LMHeadModel(cfg).parameters())
    assert (t.op == SAVE).sum() > 0 and t.flops.sum() > 0


def test_the_target_devices_attention_kernels():
    # Training with dropout: CPU runs SDPA's math path (batch x heads x seq x seq weights are saved), CUDA
    # memory-efficient attention (a log-sum-exp per row).
    scores = 4 * 4 * 64 * 64 * 4  # batch 4, 4 heads, 64 tokens, fp32
    cpu = capture(lambda: Attention(dropout=0.1), attention_batch, 4, target="cpu")
    cuda = capture(lambda: Attention(dropout=0.1), attention_batch, 4, target="cuda")
    assert scores in cpu.size[cpu.op == SAVE].tolist()
    assert max(cuda.size[cuda.op == SAVE].tolist()) < scores
    assert live_peak(cuda) < live_peak(cpu)


def test_a_foreach_optimizer_step_moves_the_bytes_of_the_for_loop():
    # SGD with momentum reads and writes the same tensors whether it loops over parameters (CPU) or uses the
    # in-place foreach kernels (CUDA), which return nothing: their writes count too.
    def sgd(params):
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)

    def optimizer_bytes(t):
        b, e = t.iterations()[-1]
        step = (t.op[b:e] == OP) & (t.phase[b:e] == PHASE["optimizer"])
        return t.bytes[b:e][step].sum(), step.sum()

    (cpu, cpu_ops), (cuda, cuda_ops) = (optimizer_bytes(capture(TinyCNN, cnn_batch, 4, optimizer=sgd, target=target))
                                        for target in ("cpu", "cuda"))  # fmt: skip
    params = sum(p.numel() * 4 for p in TinyCNN().parameters())
    # Per parameter byte: momentum *= m (read, write), += grad (read two, write), param -= lr * buf (idem).
    assert cuda == cpu >= 8 * params
    assert cuda_ops < cpu_ops  # a few foreach kernels instead of a loop over the parameters


def test_traces_scale_linearly_with_the_batch_and_say_when_they_do_not():
    lt = LinearTrace.fit(capture(TinyCNN, cnn_batch, 2), capture(TinyCNN, cnn_batch, 4))
    assert lt is not None
    real = capture(TinyCNN, cnn_batch, 9)
    assert lt.check(real) is None
    assert (lt.at(9).size == real.size).all() and live_peak(lt.at(9)) == live_peak(real)
    # A batch x batch similarity matrix is quadratic: two captures cannot be fitted, or the third disagrees.
    a, b = (capture(Contrastive, contrastive_batch, n, contrastive_loss) for n in (2, 4))
    quad = LinearTrace.fit(a, b)
    assert quad is None or quad.check(capture(Contrastive, contrastive_batch, 3, contrastive_loss)) is not None
    # The check compares event by event: a model with other sizes is caught.
    assert "linear extrapolation" in lt.check(capture(lambda: TinyCNN(width=9), cnn_batch, 3))


class Masked(nn.Module):
    def forward(self, x):
        return x + x[x > 0].sum()


class Branchy(nn.Module):
    def forward(self, x):
        return x * 2 if x.mean() > 0 else x


def tiny(block):
    return lambda: nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), block()), nn.Linear(8, 4))


def vectors(n):
    return torch.randn(n, 8), torch.randint(0, 4, (n,))


@pytest.mark.parametrize(
    "block, op, advice",
    [(Masked, "aten.index", "output shape depends on tensor values"), (Branchy, "_local_scalar_dense", "value")],
)
def test_data_dependent_operators_are_named_with_their_module(block, op, advice):
    with pytest.raises(CaptureError) as e:
        capture(tiny(block), vectors, 4)
    assert op in e.value.op and e.value.module == f"module `1.1` ({block.__name__})"
    assert e.value.phase == "forward and loss"
    assert advice in str(e.value) and "What to do" in str(e.value)


def test_custom_kernels_without_a_meta_implementation():
    @torch.library.custom_op("swap_plan_test::double", mutates_args=())
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    double.register_autograd(lambda ctx, grad: grad * 2)

    class Custom(nn.Module):
        def forward(self, x):
            return double(x)

    with pytest.raises(CaptureError, match="register_fake") as e:
        capture(tiny(Custom), vectors, 4)
    assert "swap_plan_test.double" in e.value.op

    @double.register_fake
    def _(x):
        return torch.empty_like(x)

    assert len(capture(tiny(Custom), vectors, 4)) > 0  # with a fake implementation it captures


def test_hugging_face_padding_checks_get_advice():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=100, max_position_embeddings=32)  # fmt: skip

    def batch(n, mask=True):
        ids = torch.randint(0, 100, (n, 16))
        out = {"input_ids": ids, "labels": ids}
        return {**out, "attention_mask": torch.ones(n, 16, dtype=torch.long)} if mask else out

    with pytest.raises(CaptureError, match="leave attention_mask out of the batch"):
        capture(lambda: transformers.BertForMaskedLM(cfg), batch, 2)
    assert len(capture(lambda: transformers.BertForMaskedLM(cfg), lambda n: batch(n, mask=False), 2)) > 0


def test_default_loss():
    lm = nn.Linear(4, 10)
    x, y = torch.randn(2, 3, 4), torch.randint(0, 10, (2, 3))
    assert default_loss(lm, (x, y)).shape == ()  # [batch, seq, classes] against [batch, seq]
    with pytest.raises(ValueError, match="no .loss"):
        default_loss(lambda **kw: {"logits": 1}, {"x": x})
    with pytest.raises(ValueError, match="pass loss_fn"):
        default_loss(lm, x)


def test_small_saves_stay_and_the_swapped_trace_keeps_the_budget():
    t = capture(TinyCNN, cnn_batch, 16)
    everything, big = sequence_from_trace(t), sequence_from_trace(t, min_bytes=16 * 1024)
    assert len(big.sizes) < len(everything.sizes) and min(big.sizes) >= 16 * 1024
    assert big.no_swap_peak() == everything.no_swap_peak()  # small saves count as memory that is not swappable
    assert sum(big.compute) == sum(everything.compute) == 0.0  # no cost model: no time
    budget = (big.step_floor() + big.no_swap_peak()) // 2
    schedule = make_schedule(big, budget, None, "all")
    s = swapped(t, budget, schedule=schedule, min_bytes=16 * 1024)
    assert live_peak(s) <= budget < live_peak(t)
    assert_balanced(s)
