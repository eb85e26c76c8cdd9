"""The LM head and cross-entropy tiled along tokens match the untiled loss and gradients (HF models too).

Tolerance: as Note [Tiled gradient tolerance] (tests/swap/tiling/test_tiled_spatial.py), float32 relative to each
tensor's largest element: the head's weight gradient is a sum over token tiles instead of over all tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tiling_models import assert_close

import swap
from swap.planning.tiling.head import HeadShape, tokens_per_tile

transformers = pytest.importorskip("transformers")


def test_tiled_cross_entropy_matches_with_ignored_rows() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50)
    h1 = torch.randn(37, 16, requires_grad=True)
    h2 = h1.detach().clone().requires_grad_()
    y = torch.randint(0, 50, (37,))
    y[::5] = -100
    ref = F.cross_entropy(head(h1), y, reduction="sum")
    ref.backward()
    ref_w = head.weight.grad.clone()
    head.zero_grad()
    loss = swap.tiled_cross_entropy(h2, head, y, tokens=8)
    loss.backward()
    assert_close(loss.detach(), ref.detach(), "loss")
    assert_close(h2.grad, h1.grad, "hidden gradient")
    assert_close(head.weight.grad, ref_w, "head weight gradient")


def _compare(model: torch.nn.Module, budget: int, vocab: int) -> swap.TiledCausalLM:
    torch.manual_seed(0)
    twin = copy.deepcopy(model)
    tiled = swap.tiled(twin, budget=budget)
    ids = torch.randint(0, vocab, (2, 24))
    labels = ids.clone()
    labels[0, :5] = -100
    ref = model(input_ids=ids, labels=labels)
    ref.loss.backward()
    out = tiled(input_ids=ids, labels=labels)
    out.loss.backward()
    assert out.logits is None
    assert_close(out.loss.detach(), ref.loss.detach(), "loss")
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close(q.grad, p.grad, name)
    return tiled


def test_gpt2_lm_head_model_tiled_along_tokens() -> None:
    config = transformers.GPT2Config(vocab_size=211, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).eval()  # eval: no dropout, so both runs draw nothing
    shape = HeadShape(2 * 23, 32, 211)
    budget = shape.fixed_bytes() + shape.tile_bytes(10)
    tiled = _compare(model, budget, 211)
    assert tiled.last_tokens == 10  # 46 tokens in 5 tiles; the tied embedding gets both its gradients
    assert model.get_output_embeddings().weight is model.transformer.wte.weight


def test_llama_for_causal_lm_tiled_along_tokens() -> None:
    config = transformers.LlamaConfig(vocab_size=173, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64)  # fmt: skip
    tiled = _compare(transformers.LlamaForCausalLM(config), HeadShape(46, 32, 173).fixed_bytes() + 173 * 20 * 7, 173)
    assert 1 < tiled.last_tokens < 46


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
