"""Which operators save their output (swap.joint.autograd_saves), against the autograd nodes torch builds."""

import pytest
import torch
import torch.nn.functional as F

from swap.joint import autograd_saves
from swap.joint.autograd_saves import saves_first_output

# An operator name and a call that dispatches exactly it on a leaf that requires grad (in place: on a clone).
CALLS = {
    "aten.relu.default": torch.relu,
    "aten.relu_.default": lambda x: torch.relu_(x.clone()),
    "aten.elu.default": F.elu,
    "aten.elu_.default": lambda x: F.elu_(x.clone()),
    "aten.hardtanh.default": F.relu6,
    "aten.leaky_relu.default": F.leaky_relu,
    "aten.leaky_relu_.default": lambda x: F.leaky_relu_(x.clone()),
    "aten.threshold.default": lambda x: F.threshold(x, 0.1, 0.0),
    "aten.sigmoid.default": torch.sigmoid,
    "aten.tanh.default": torch.tanh,
    "aten.exp.default": torch.exp,
    "aten.expm1.default": torch.expm1,
    "aten.reciprocal.default": torch.reciprocal,
    "aten.sqrt.default": torch.sqrt,
    "aten.gelu.default": F.gelu,
    "aten.silu.default": F.silu,
    "aten._softmax.default": lambda x: torch.softmax(x, -1),
    "aten._log_softmax.default": lambda x: torch.log_softmax(x, -1),
    "aten.logsumexp.default": lambda x: torch.logsumexp(x, -1),
    "aten.amax.default": lambda x: torch.amax(x, -1),
    "aten.mul.Tensor": lambda x: x * x,
    "aten.native_layer_norm.default": lambda x: F.layer_norm(x, x.shape[-1:]),
}


def node_saves_its_output(fn) -> bool:
    """Whether the autograd node ``fn`` builds on a fresh leaf holds its output (``_saved_result``, or the
    first of ``_saved_result0``...)."""
    x = torch.rand(4, 8, dtype=torch.float64) + 0.5
    node = fn(x.requires_grad_()).grad_fn
    return hasattr(node, "_saved_result") or hasattr(node, "_saved_result0")


@pytest.mark.parametrize("name", sorted(CALLS))
def test_the_derivatives_table_says_what_autograd_saves(name):
    assert saves_first_output(name) == node_saves_its_output(CALLS[name])


@pytest.mark.parametrize("name", sorted(CALLS))
def test_without_the_table_the_fallback_list_agrees(name, monkeypatch):
    monkeypatch.setattr(autograd_saves, "_table", lambda: None)
    autograd_saves.saves_first_output.cache_clear()
    try:
        assert saves_first_output(name) == node_saves_its_output(CALLS[name])
    finally:
        autograd_saves.saves_first_output.cache_clear()


def test_operators_outside_aten_are_not_assumed_to_save_their_output():
    assert not saves_first_output("prims.add.default") and not saves_first_output("mylib.custom.default")
