"""The FLOPs of one dispatched operator: PyTorch's flop counter, plus the kernels it does not know.

Note [FLOPs of the CPU attention kernels]
``torch.utils.flop_counter`` counts the CUDA attention kernels (flash, memory-efficient, cuDNN) but not the
CPU's flash attention (``_scaled_dot_product_flash_attention_for_cpu`` and its backward), which is what SDPA
runs on a CPU and what a capture with ``target="cpu"`` records (Note [The target device's kernels]). Without
a formula those operators cost nothing on the roofline but their bytes: on the plan-vs-reality U-Net they
take 1.43 of its 2.32 s per CPU step (bench/results/plan_vs_reality_time.md). They get the CUDA kernels'
formulas (the same matmuls; like PyTorch's counter, causal masking is not discounted).

The grouped matmul of mixture-of-experts layers (``_grouped_mm``) has no formula there either: each output
element is one dot product over the contraction, except when both operands are 2-D, where the groups split the
contraction itself and each output element sums over one group's share.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def _cpu_flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        *args: Any, **kwargs: Any) -> int:  # fmt: skip
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def _grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    out = kwargs["out_val"]
    groups = out.shape[0] if mat_a.dim() == 2 and mat_b.dim() == 2 else 1
    return 2 * out.numel() * mat_a.shape[-1] // groups


EXTRA = {
    aten._grouped_mm: _grouped_mm,
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}


def operator_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """FLOPs of ``func(*args, **kwargs)`` that returned ``out``; 0 for operators without a formula."""
    packet = func._overloadpacket
    if packet in EXTRA:
        return float(EXTRA[packet](*args, **kwargs, out_val=out))
    flop_fn = flop_registry.get(packet)
    return float(flop_fn(*args, **kwargs, out_val=out)) if flop_fn is not None else 0.0
