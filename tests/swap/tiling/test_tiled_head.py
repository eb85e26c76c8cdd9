"""The LM head and cross-entropy tiled along tokens match the untiled loss and gradients (HF models too, tied
weights, ignored rows, bf16), and the backward runs no linear: each tile's gradients are taken in the forward.

Tolerance: as Note [Tiled gradient tolerance] (tests/swap/tiling/test_tiled_spatial.py), relative to each
tensor's largest element: the head's weight gradient is a sum over token tiles instead of over all tokens.

Note [bf16 head tolerance]
With bf16 weights both runs round every gradient to bf16 (8 significant bits, 2^-8 relative) at each operator
of the trunk's backward, and the tiled head rounds the logits' gradient before it is scaled by 1 / count where
the untiled one rounds it after. So the two bf16 runs differ by a few roundings per element: measured up to
1.6e-2 of the largest element on these GPT-2 / Llama models, each run being 1-2e-2 away from float64. The
tolerance is 2^-5 (3.1e-2, 8 roundings); a dropped tile, a missing tied-weight term or a wrong scale errs by
1e-1 and more. The loss is fp32 in both runs and is held to the float32 tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tiling_models import TOLERANCE, assert_close
from torch.utils._python_dispatch import TorchDispatchMode

import swap
from swap.tiling.plan.head import HeadShape, tokens_per_tile

transformers = pytest.importorskip("transformers")

LINEAR_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default,
              torch.ops.aten.bmm.default, torch.ops.aten.linear.default, torch.ops.aten.matmul.default}  # fmt: skip


class CountLinear(TorchDispatchMode):
    """Counts the matrix products that run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += func in LINEAR_OPS
        return func(*args, **(kwargs or {}))


def _head_case(dtype: torch.dtype, seed: int = 0) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    head = torch.nn.Linear(16, 50).to(dtype)
    h = torch.randn(37, 16, dtype=dtype)
    y = torch.randint(0, 50, (37,))
    y[::5] = -100
    return head, h, y


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_tiled_cross_entropy_matches_with_ignored_rows(dtype: torch.dtype) -> None:
    head, h, y = _head_case(dtype)
    h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
    logits = head(h1)
    ref = F.cross_entropy(logits if dtype == torch.float64 else logits.float(), y, reduction="sum") / 29
    ref.backward()
    ref_w, ref_b = head.weight.grad.clone(), head.bias.grad.clone()
    head.zero_grad()
    loss = swap.tiled_cross_entropy(h2, head, y, tokens=8) / 29
    loss.backward()
    assert loss.dtype == ref.dtype
    assert_close(loss.detach(), ref.detach(), "loss")
    assert_close(h2.grad, h1.grad, "hidden gradient")
    assert_close(head.weight.grad, ref_w, "head weight gradient")
    assert_close(head.bias.grad, ref_b, "head bias gradient")
    assert h2.grad.dtype == h1.grad.dtype and head.weight.grad.dtype == dtype


def test_under_autocast_the_head_computes_in_bf16_as_untiled() -> None:
    head, h, y = _head_case(torch.float32)
    runs = []
    for tiled in (False, True):
        head.zero_grad()
        x = h.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits_loss = swap.tiled_cross_entropy(x, head, y, tokens=8) if tiled else \
                F.cross_entropy(head(x).float(), y, reduction="sum")
        (logits_loss / 29).backward()
        runs.append((logits_loss.detach(), x.grad, head.weight.grad.clone(), head.bias.grad.clone()))
    (ref_loss, *ref), (loss, *got) = runs
    assert_close(loss, ref_loss, "loss")  # fp32 in both
    for a, b, what in zip(got, ref, ("hidden", "weight", "bias")):
        assert a.dtype == torch.float32
        assert (a - b).abs().max() <= TOLERANCE[torch.bfloat16] * b.abs().max(), what  # Note [bf16 head tolerance]


def test_the_backward_runs_no_linear() -> None:
    head, h, y = _head_case(torch.float32)
    counts = {}
    for name, fn in (("untiled", lambda x: F.cross_entropy(head(x), y, reduction="sum")),
                     ("tiled", lambda x: swap.tiled_cross_entropy(x, head, y, tokens=8))):  # fmt: skip
        x = h.clone().requires_grad_()
        with CountLinear() as fwd:
            loss = fn(x)
        with CountLinear() as bwd:
            loss.backward()
        counts[name] = (fwd.count, bwd.count)
    assert counts["untiled"] == (1, 2)  # the counter sees the untiled head's linear and its two gradients
    assert counts["tiled"] == (15, 0)  # 5 tiles x (logits, hidden gradient, weight gradient); nothing in backward


def test_what_needs_no_gradient_is_not_computed() -> None:
    head, h, y = _head_case(torch.float32)
    ref_h = h.clone().requires_grad_()
    F.cross_entropy(head(ref_h), y, reduction="sum").backward()
    ref_w = head.weight.grad.clone()
    head.zero_grad()
    with CountLinear() as frozen_hidden:
        loss = swap.tiled_cross_entropy(h, head, y, tokens=8)  # hidden states without grad: only the weight's
    loss.backward()
    assert frozen_hidden.count == 10
    assert_close(head.weight.grad, ref_w, "head weight gradient")
    head.zero_grad()
    head.requires_grad_(False)
    x = h.clone().requires_grad_()
    with CountLinear() as frozen_head:
        loss = swap.tiled_cross_entropy(x, head, y, tokens=8)  # a frozen head: only the hidden states'
    loss.backward()
    assert frozen_head.count == 10 and head.weight.grad is None
    assert_close(x.grad, ref_h.grad, "hidden gradient")
    with torch.no_grad(), CountLinear() as no_grad:
        loss = swap.tiled_cross_entropy(h.requires_grad_(), head.requires_grad_(True), y, tokens=8)
    assert no_grad.count == 5 and not loss.requires_grad  # evaluation: the logits only


def test_tied_weights_accumulate_both_gradients() -> None:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 16)
    head = torch.nn.Linear(16, 50, bias=False)
    head.weight = emb.weight
    ids = torch.randint(0, 50, (3, 13))
    y = torch.randint(0, 50, (39,))
    F.cross_entropy(head(emb(ids).tanh()).reshape(39, 50), y, reduction="sum").backward()
    ref = emb.weight.grad.clone()
    emb.zero_grad()
    swap.tiled_cross_entropy(emb(ids).tanh(), head, y, tokens=10).backward()
    assert_close(emb.weight.grad, ref, "tied weight gradient")


def test_labels_outside_the_vocabulary_are_refused() -> None:
    head, h, y = _head_case(torch.float32)
    y[3] = 50
    with pytest.raises(ValueError, match="label 50 at row 3 is outside the vocabulary \\[0, 50\\)"):
        swap.tiled_cross_entropy(h, head, y, tokens=8)
    with pytest.raises(ValueError, match="37 hidden rows but 36 labels"):
        swap.tiled_cross_entropy(h, head, y[1:], tokens=8)


def test_on_an_accelerator_the_label_check_makes_the_host_wait_for_nothing() -> None:
    """A host read of the check's answer (``bool(bad.any())``) is one device synchronisation per forward on a
    GPU: on CUDA the check is queued on the device. Run here on CPU tensors, asking for the device path."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from swap.tiling.run.head import _check_labels

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.reads += func is torch.ops.aten._local_scalar_dense.default  # what .item(), bool(), int() run
            return func(*args, **(kwargs or {}))

    y = torch.tensor([1, 2, -100, 49])
    with HostReads() as mode:
        _check_labels(y, 50, -100, synchronous=False)
    assert mode.reads == 0
    y[3] = 50
    with pytest.raises(RuntimeError, match="outside the vocabulary \\[0, 50\\)"):
        _check_labels(y, 50, -100, synchronous=False)  # on the CPU the queued check fails at once


def _compare(model: torch.nn.Module, budget: int, vocab: int, dtype: torch.dtype = torch.float32) -> swap.TiledCausalLM:
    torch.manual_seed(0)
    model = model.to(dtype)
    twin = copy.deepcopy(model)
    tiled = swap.tiled(twin, budget=budget)
    ids = torch.randint(0, vocab, (2, 24))
    labels = ids.clone()
    labels[0, :5] = -100
    ref = model(input_ids=ids, labels=labels)
    with CountLinear() as ref_backward:
        ref.loss.backward()
    out = tiled(input_ids=ids, labels=labels)
    with CountLinear() as backward:
        out.loss.backward()
    assert backward.count == ref_backward.count - 2  # the trunk's products; none for the head (untiled: two)
    assert out.logits is None
    assert ref.loss.dtype == out.loss.dtype == torch.float32
    assert abs(out.loss.item() - ref.loss.item()) <= TOLERANCE[torch.float32] * abs(ref.loss.item())
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close(q.grad, p.grad, name)
    return tiled


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt2_lm_head_model_tiled_along_tokens(dtype: torch.dtype) -> None:
    config = transformers.GPT2Config(vocab_size=211, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).eval()  # eval: no dropout, so both runs draw nothing
    shape = HeadShape(2 * 23, 32, 211, itemsize=dtype.itemsize)
    budget = shape.fixed_bytes() + shape.tile_bytes(10)
    tiled = _compare(model, budget, 211, dtype)
    assert tiled.last_tokens == 10  # 46 tokens in 5 tiles; the tied embedding gets both its gradients
    assert model.get_output_embeddings().weight is model.transformer.wte.weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_for_causal_lm_tiled_along_tokens(dtype: torch.dtype) -> None:
    config = transformers.LlamaConfig(vocab_size=173, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64)  # fmt: skip
    shape = HeadShape(46, 32, 173, itemsize=dtype.itemsize)
    tiled = _compare(transformers.LlamaForCausalLM(config), shape.fixed_bytes() + shape.tile_bytes(20), 173, dtype)
    assert tiled.last_tokens == 20


def test_a_progress_callable_gets_the_head_tiles_lines_not_stderr(capsys: pytest.CaptureFixture) -> None:
    config = transformers.GPT2Config(vocab_size=211, n_embd=32, n_layer=1, n_head=2, n_positions=32)
    lines: list[str] = []
    tiled = swap.tiled(transformers.GPT2LMHeadModel(config).eval(), tiles=10, progress=lines.append)
    ids = torch.randint(0, 211, (2, 24))
    tiled(input_ids=ids, labels=ids)
    assert lines == [f"forward tile {k}/5" for k in range(1, 6)]  # 46 tokens, 10 per tile
    assert capsys.readouterr().err == ""


def test_tokens_per_tile_from_the_budget_and_the_error_below_one_token() -> None:
    shape = HeadShape(tokens=8192, hidden=1024, vocab=50257, itemsize=2)
    t = tokens_per_tile(shape, 2 << 30)
    assert shape.fixed_bytes() + shape.tile_bytes(t) <= 2 << 30 < shape.fixed_bytes() + shape.tile_bytes(t + 1)
    assert tokens_per_tile(shape, shape.untiled_bytes()) == 8192
    with pytest.raises(swap.HeadInfeasible, match="lm_head \\+ cross_entropy") as info:
        tokens_per_tile(shape, shape.fixed_bytes())
    assert info.value.working_set == shape.fixed_bytes() + shape.tile_bytes(1)


def test_a_model_that_is_not_a_causal_lm_is_tiled_spatially_or_refused() -> None:
    with pytest.raises(TypeError, match="causal LM"):
        swap.TiledCausalLM(torch.nn.Linear(3, 3), tokens=4)


class TinyLM(torch.nn.Module):
    """An embedding, one mixing layer and a head tied to the embedding."""

    def __init__(self, vocab: int = 211, hidden: int = 32) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mix(self.emb(ids)).tanh()


def test_the_capture_sees_the_gradients_held_to_backward_and_no_product_there() -> None:
    from swap.capture import OP, PHASE, SAVE, capture

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, 211, (n, 24)), torch.randint(0, 211, (n, 24))

    def untiled(model: TinyLM, b: tuple) -> torch.Tensor:
        return F.cross_entropy(model.head(model(b[0])).flatten(0, 1).float(), b[1].flatten())

    def tiled(model: TinyLM, b: tuple) -> torch.Tensor:
        return swap.tiled_cross_entropy(model(b[0]), model.head, b[1], tokens=16) / b[1].numel()

    seen = {}
    for name, loss in (("untiled", untiled), ("tiled", tiled)):
        t = capture(TinyLM, batch, 4, loss, target="cpu")
        b, e = t.iterations()[-1]
        ops = [t.op_name(k) for k in range(b, e + 1) if t.op[k] == OP and t.phase[k] == PHASE["backward"]]
        saved = [int(t.size[k]) for k in range(b, e + 1) if t.op[k] == SAVE]
        seen[name] = (sum(o in ("aten.mm.default", "aten.addmm.default") for o in ops), saved)
    (untiled_mm, untiled_saved), (tiled_mm, tiled_saved) = seen["untiled"], seen["tiled"]
    assert tiled_mm == untiled_mm - 2  # the head's two backward products are gone, and nothing is recomputed
    assert 96 * 32 * 4 in tiled_saved and 211 * 32 * 4 in tiled_saved  # grad_hidden and grad_W, saved to backward
    assert 96 * 211 * 4 not in tiled_saved and 96 * 211 * 4 in untiled_saved  # no tokens x vocab tensor held


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_measured_peak_is_within_the_memory_model(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    vocab, hidden_size, rows, tokens = 500, 16, 300, 64
    head = torch.nn.Linear(hidden_size, vocab, bias=False).to(dtype)
    leaf = torch.randn(rows, hidden_size, dtype=dtype, requires_grad=True)
    y = torch.randint(0, vocab, (rows,))
    shape = HeadShape(rows, hidden_size, vocab, itemsize=dtype.itemsize)
    with swap.LiveBytesMeter() as meter:
        hidden = leaf * 2  # the hidden states, freed after the forward as a model's final norm output is
        loss = swap.tiled_cross_entropy(hidden, head, y, tokens=tokens)
        del hidden
        loss.backward()
        assert leaf.grad is not None and head.weight.grad is not None
    predicted = shape.fixed_bytes() + shape.tile_bytes(tokens)
    # Note [Tiled head and loss]: an upper bound, and a tight one (what it leaves out is small: the loss's
    # per-row vectors; leaf.grad and the weight's .grad are counted, as the model counts them)
    assert 0.9 * predicted <= meter.peak <= predicted, (meter.peak, predicted)
