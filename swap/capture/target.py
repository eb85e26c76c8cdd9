"""What a capture substitutes so that the meta device runs what the target device would.

Note [The target device's kernels]
The meta device runs the reference decomposition of ``scaled_dot_product_attention`` (the math path, which
materializes batch x heads x seq x seq attention weights), and PyTorch's optimizers take their for-loop path
for it. A GPU does neither: SDPA runs flash attention (fp16/bf16, no mask) or memory-efficient attention,
which save only a log-sum-exp per row, and optimizers default to ``foreach`` kernels with whole-model
temporaries. ``target="cuda"`` therefore routes SDPA to the CUDA kernels' own meta implementations and lets
optimizers see meta tensors as foreach-capable; ``target="cpu"`` mirrors the CPU dispatcher (flash
attention for CPU where PyTorch's own choice picks it, else the math path: with dropout, or a mask that
requires grad; for-loop optimizers), which is what the plan-vs-reality check on CPU compares with.

Note [Value checks of libraries]
Some libraries read tensor values in a training step only to pick a fast path, where the value a real batch
gives is known. The meta device has no values, so the capture answers such a check as a real batch would:

- Hugging Face transformers (``masking_utils.find_packed_sequence_indices``): with no attention mask and
  no cache (training with gradient checkpointing turns the cache off), it reads ``position_ids`` to detect
  several sequences packed into one row. Position ids the model makes itself are ``arange`` per row, never
  packed: the answer is None (not packed). A batch that passes packed ``position_ids`` of its own would
  take the packed path for real, which the capture does not model.

Everything else that reads values still fails with a ``CaptureError`` naming the operator.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Optional

import torch
from torch.nn.attention import SDPBackend


def _float_mask(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """SDPA turns a boolean mask into an additive one before any fused kernel sees it."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask.logical_not(), float("-inf"))


@contextlib.contextmanager
def target_kernels(target: str) -> Iterator[None]:
    """Routes ``scaled_dot_product_attention`` on meta tensors to the target's kernels while capturing.

    The route is a kernel for SDPA at the dispatcher's AutogradMeta key (SDPA is a composite operator, so
    that key runs before its decomposition), not a torch-function mode: the autograd engine runs the
    backward, and with it every checkpointed recompute, without the torch-function modes that were active
    when ``backward()`` was called, so a recompute would take the math path and save other tensors than the
    forward did (torch.utils.checkpoint then refuses). A dispatcher kernel holds in the recompute too.
    Other meta-device SDPA calls in the process take the same route while a capture runs.
    """
    aten = torch.ops.aten.scaled_dot_product_attention.default

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):  # noqa: ANN001, ANN202
        out = _target_sdpa(target, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if out is None:  # what the device's own dispatcher runs: the composite (math) path
            return aten.decompose(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        return out

    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("scaled_dot_product_attention", sdpa, "AutogradMeta")
        yield
    finally:
        lib._destroy()


def _target_sdpa(target: str, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # noqa: ANN001, ANN202
    if q.device.type != "meta" or q.dim() != 4 or k.dim() != 4 or q.shape[-1] != v.shape[-1]:
        return None
    if target == "cpu" and not _cpu_picks_flash(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return None
    if enable_gqa and k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if target == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=_float_mask(attn_mask, q.dtype), scale=scale
        )[0]
    if attn_mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
    bias = _float_mask(attn_mask, q.dtype)
    if bias is not None:
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    grad = q.requires_grad or k.requires_grad or v.requires_grad
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, grad, dropout_p, is_causal, scale=scale
    )[0]


def _cpu_picks_flash(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> bool:  # noqa: ANN001
    """Whether the CPU dispatcher runs these meta inputs on its flash kernel (else the math path): PyTorch's own
    choice (``_fused_sdp_choice``, what SDPA asks on a CPU) asked about CPU stand-ins of one row each, with the
    same shapes, dtypes, last-dimension strides and ``requires_grad``. It takes the math path with dropout, and
    when the mask requires grad (a learned bias, as Swin's relative positions are), which flash cannot
    differentiate."""

    def stand_in(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None or t.dim() == 0:
            return None if t is None else torch.zeros((), dtype=t.dtype)
        step = 1 if t.stride(-1) == 1 else 2
        row = torch.zeros(t.shape[-1] * step, dtype=t.dtype)[::step]
        return row.requires_grad_(t.requires_grad and t.is_floating_point()).expand(t.shape)

    with torch._C._DisableTorchDispatch():  # the capture must not record its question
        choice = torch.ops.aten._fused_sdp_choice(stand_in(q), stand_in(k), stand_in(v), stand_in(attn_mask),
                                                  dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)  # fmt: skip
    return choice == int(SDPBackend.FLASH_ATTENTION)


@contextlib.contextmanager
def foreach_on_meta(enabled: bool) -> Iterator[None]:
    """Optimizers pick foreach kernels for CUDA parameters; make them do so for meta ones too."""
    import torch.optim.optimizer as optimizer_module

    original = getattr(optimizer_module, "_get_foreach_kernels_supported_devices", None)
    if not enabled or original is None:
        yield
        return
    optimizer_module._get_foreach_kernels_supported_devices = lambda: [*original(), "meta"]
    try:
        yield
    finally:
        optimizer_module._get_foreach_kernels_supported_devices = original


def _not_packed(position_ids: torch.Tensor) -> None:
    return None


@contextlib.contextmanager
def library_value_checks() -> Iterator[None]:
    """Answers the value checks of Note [Value checks of libraries] while capturing."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking.find_packed_sequence_indices = _not_packed
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original
