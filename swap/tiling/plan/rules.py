"""Which operators a fused tile may run, and how each reads its input (FT-compatibility: an operator
may run on a tile along a dimension when an output slice needs only a bounded input slice there).

Note [FT-compatible operators]
An operator is tiled along its spatial dimensions (every dimension after batch and channel) when an output
slice of extent T needs only an input slice of extent σ·T + δ, with the same batch and channels:

- windows: ``nn.Conv1d/2d/3d`` (σ = stride, δ = dilation·(kernel - 1); zero padding, any groups; 'same' and
  'valid' too), ``nn.MaxPool1d/2d/3d`` and ``F.max_pool*d`` (padding and ceil_mode included: padding is
  -inf), ``nn.AvgPool1d/2d/3d`` and ``F.avg_pool*d`` (no padding, or padding counted in the divisor, which
  is PyTorch's default; ceil_mode off);
- pointwise (σ = 1, δ = 0): ReLU, ReLU6, LeakyReLU, PReLU with one parameter, ELU, SELU, CELU, GELU, SiLU,
  Mish, Sigmoid, Tanh, Hardtanh, Hardswish, Hardsigmoid, Softplus, Identity, as modules, ``F.``/``torch.``
  functions or tensor methods; arithmetic with a Python number (``x * 0.5``, ``x + 1``);
  ``BatchNorm1d/2d/3d`` in eval mode (it normalizes with its running statistics: a per-channel affine map,
  exact per tile); ``Dropout`` in eval mode.

What ends a segment (runs untiled, on whole tensors, between segments), with the reason the error and the
plan give:

- BatchNorm in training mode, or without running statistics: it normalizes with statistics over the whole
  batch *and image*, which no tile has. (Chosen over a statistics pre-pass: the pre-pass would need a
  second pass over every tile in forward and an exact correction term in backward; the segment boundary is
  exact at no cost to models in eval-mode norms, which is how large-image models are fine-tuned.)
- Dropout in training mode: a tile and its halo-overlapping neighbour, and the backward's recompute, would
  draw different masks for the same element.
- global or adaptive pooling, ``nn.Linear`` (it mixes the last dimension, which is spatial in NC...
  layouts), ``flatten``/``view``/``reshape``, softmax and normalization over a spatial dimension,
  transposed convolutions, non-zero padding modes, GroupNorm/InstanceNorm/LayerNorm (statistics over space);
- any operator that joins two activations (a residual add, ``torch.cat``): segments are chains; and any
  operator not listed above.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .geometry import Window

CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
MAXPOOL = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)
AVGPOOL = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)
NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
POINTWISE_MODULES = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh,
    nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Identity,
)  # fmt: skip
POINTWISE_FUNCTIONS: set[Any] = {
    F.relu, F.relu_, torch.relu, torch.relu_, F.relu6, F.leaky_relu, F.leaky_relu_, F.elu, F.selu, F.celu,
    F.gelu, F.silu, F.mish, torch.sigmoid, F.sigmoid, torch.tanh, F.tanh, F.hardtanh, F.hardswish,
    F.hardsigmoid, F.softplus,
}  # fmt: skip
POINTWISE_METHODS = {"relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "contiguous", "clone"}
ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub, torch.mul,
              torch.div, operator.iadd, operator.imul}  # fmt: skip
ARITHMETIC_METHODS = {"add", "sub", "mul", "div", "add_", "mul_"}
POOL_FUNCTIONS: dict[Any, type] = {
    F.max_pool1d: nn.MaxPool1d, F.max_pool2d: nn.MaxPool2d, F.max_pool3d: nn.MaxPool3d,
    F.avg_pool1d: nn.AvgPool1d, F.avg_pool2d: nn.AvgPool2d, F.avg_pool3d: nn.AvgPool3d,
}  # fmt: skip


@dataclass(frozen=True)
class Rule:
    """How an operator tiles: ``kind`` "window" (reads σ·T + δ), "pointwise" (reads T) or "barrier" (ends
    a segment, ``reason`` says why). ``layer`` is what the runtime calls on a padded tile (the module, or a
    pooling module built from a functional call); ``pad_value`` fills the padding a border tile adds."""

    kind: str
    windows: tuple[Window, ...] = ()
    pad_value: float = 0.0
    reason: str = ""
    layer: Optional[nn.Module] = None

    @property
    def tileable(self) -> bool:
        return self.kind != "barrier"


def barrier(reason: str) -> Rule:
    return Rule("barrier", reason=reason)


def _per_dim(value: Any, n: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (int(value),) * n


def _conv(m: nn.Module) -> Rule:
    n = m.weight.dim() - 2
    if m.padding_mode != "zeros":
        return barrier(f"padding_mode={m.padding_mode!r}: only zero padding is tiled exactly")
    k, s, d = _per_dim(m.kernel_size, n), _per_dim(m.stride, n), _per_dim(m.dilation, n)
    if isinstance(m.padding, str):  # 'same' puts the odd position on the right, as PyTorch does
        p = tuple(0 if m.padding == "valid" else d[i] * (k[i] - 1) // 2 for i in range(n))
    else:
        p = _per_dim(m.padding, n)
    return Rule("window", tuple(Window(k[i], s[i], p[i], d[i]) for i in range(n)), 0.0, layer=m)


def _pool(m: nn.Module) -> Rule:
    n = 1 if isinstance(m, (nn.MaxPool1d, nn.AvgPool1d)) else 2 if isinstance(m, (nn.MaxPool2d, nn.AvgPool2d)) else 3
    k = _per_dim(m.kernel_size, n)
    s = _per_dim(m.stride if m.stride else m.kernel_size, n)
    p = _per_dim(m.padding, n)
    if isinstance(m, MAXPOOL):
        if m.return_indices:
            return barrier("max pooling that returns its indices")
        d = _per_dim(m.dilation, n)
        return Rule("window", tuple(Window(k[i], s[i], p[i], d[i], True) for i in range(n)), -math.inf, layer=m)
    if m.ceil_mode:
        return barrier("average pooling with ceil_mode=True divides the last window by its clipped size")
    if any(p) and not m.count_include_pad:
        return barrier("average pooling with padding and count_include_pad=False divides border windows "
                       "by their clipped size")  # fmt: skip
    return Rule("window", tuple(Window(k[i], s[i], p[i], 1, True) for i in range(n)), 0.0, layer=m)


def classify_module(m: nn.Module) -> Rule:
    """The rule for calling module ``m`` in its current train/eval mode."""
    if isinstance(m, CONV):
        return _conv(m)
    if isinstance(m, MAXPOOL + AVGPOOL):
        return _pool(m)
    if isinstance(m, NORMS):
        if m.training or not m.track_running_stats:
            return barrier(f"{type(m).__name__} in training mode normalizes with statistics over the whole "
                           "image (call .eval() on it to tile it: running statistics are exact per tile)")  # fmt: skip
        return Rule("pointwise", layer=m)
    if isinstance(m, nn.Dropout):
        if m.training and m.p > 0:
            return barrier("Dropout in training mode draws a different mask per tile and in the recompute")
        return Rule("pointwise", layer=m)
    if isinstance(m, nn.PReLU):
        if m.num_parameters == 1:
            return Rule("pointwise", layer=m)
        return barrier("PReLU with one parameter per channel is not in the tiled set")
    if isinstance(m, POINTWISE_MODULES):
        return Rule("pointwise", layer=m)
    return barrier(f"{type(m).__name__} is not FT-compatible (Note [FT-compatible operators])")


def classify_call(target: Any, tensor_args: int, args: tuple, kwargs: dict, method: bool = False) -> Rule:
    """The rule for a function or method call with ``tensor_args`` activation arguments (one: a chain)."""
    name = target if method else getattr(target, "__name__", str(target))
    if tensor_args != 1:
        return barrier(f"{name} joins {tensor_args} activations; tiled segments are chains of one tensor")
    if method:
        if target in POINTWISE_METHODS or target in ARITHMETIC_METHODS:
            return Rule("pointwise")
        return barrier(f"tensor method .{target}() is not FT-compatible (Note [FT-compatible operators])")
    if target in POINTWISE_FUNCTIONS or target in ARITHMETIC:
        return Rule("pointwise")
    if target in POOL_FUNCTIONS:
        try:
            layer = POOL_FUNCTIONS[target](*args[1:], **kwargs)
        except TypeError as e:
            return barrier(f"{name} with arguments it cannot be rebuilt from ({e})")
        return _pool(layer)
    return barrier(f"{name} is not FT-compatible (Note [FT-compatible operators])")

