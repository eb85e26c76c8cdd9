"""The head and cross-entropy tile by tile along tokens, with their gradients taken in the forward: backward
runs no linear (Note [Gradients in the forward] in swap/tiling/plan/head.py).

Note [Head gradient precision]
Per tile, the logits come out of the head in its compute dtype (the weight's, or autocast's) and are upcast
to fp32, as Hugging Face's loss does; the loss, the softmax and the logits' gradient (softmax - onehot) are
computed in fp32, and the gradient is cast back to the compute dtype for the two matmuls, as autograd casts
the upcast's gradient in the untiled backward. The hidden states' gradient rows depend on their own tile
only, so they are the untiled ones up to the scaling order. The weight's gradient is a sum over tiles: it is
accumulated and held in **fp32** (``V × H × 4`` bytes), each tile's product rounded once to the compute
dtype, so its error does not grow with the number of tiles, where accumulating in bf16 would round the
running sum once per tile; the incoming gradient scales it in fp32 and it is rounded to the weight's dtype
once, in backward. The cost over the weight's dtype is ``V × H × 2`` bytes for a bf16 head (98 MiB for
GPT-2's 50257 × 1024), held from the head's forward to its backward, which comes first in the step's
backward. The bias's gradient is summed in fp32 likewise.

Note [Fewest passes over the logits]
A tile's logits (tokens × vocab) dwarf everything else it touches, so its cost is the passes over them, in
bytes per logit for a bf16 head: the head's product writes them (2), one argmax reads them (2), one upcast
reads them and writes fp32 (6), one out-of-place softmax reads and writes fp32 (8), the cast back reads the
probabilities and writes the gradient (6): 24 bytes, against 60 for an in-place softmax (max, subtract,
exp, sum, divide: 32) that also subtracts the onehot and zeroes ignored rows as whole passes (16). The
rest touches one column: the log-sum-exp is z_top - log p_top (p_top >= 1 / vocab never underflows, p_target
may), the target's p - 1 is taken in fp32 from it and scattered into the cast gradient (in bf16 a confident
target's small p - 1 would cancel), and rows without a target are masked on the tokens × hidden side: their
hidden-gradient rows and their rows of the weight's product are multiplied by 0. The upcast is explicit so
that the bf16 logits are freed before the softmax allocates (``softmax(dtype=float32)`` would upcast inside
and hold both), which makes a tile's peak the fp32 logits and their softmax.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def _tile(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
          ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One tile's summed loss (fp32, or float64 for a float64 head), the gradient of that sum with respect to
    its logits in their compute dtype (Note [Head gradient precision]; rows without a target are *not*
    zeroed, Note [Fewest passes over the logits]) and which rows count; the logits are freed on return."""
    logits = F.linear(x, weight, bias)
    compute = logits.dtype
    valid = y != ignore_index
    target = torch.where(valid, y, 0).unsqueeze(1)
    top = logits.argmax(1, keepdim=True)
    z = logits.to(torch.promote_types(compute, torch.float32))  # the same tensor when the head computes in fp32
    at_top, at_target = z.gather(1, top), z.gather(1, target)
    del logits
    p = torch.softmax(z, 1)
    del z
    lse = at_top - p.gather(1, top).log()  # p_top >= 1 / vocab: its log is exact where p_target may underflow
    loss = torch.where(valid, (lse - at_target).squeeze(1), 0.0).sum()
    g = p.to(compute)  # the same tensor when the head computes in fp32
    del p
    g.scatter_(1, target, ((at_target - lse).exp() - 1).to(compute))  # softmax - onehot, the difference in fp32
    return loss, g, valid.unsqueeze(1)


class LinearCrossEntropy(torch.autograd.Function):
    """``sum(cross_entropy(linear(hidden, weight, bias).float(), labels))`` in tiles of ``tokens`` rows,
    its gradients computed in forward (Note [Gradients in the forward]). ``need`` says which of hidden,
    weight, bias need a gradient (those that do not are skipped)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                labels: torch.Tensor, tokens: int, ignore_index: int, need: tuple[bool, bool, bool],
                progress: Optional[Callable[[str], None]]) -> torch.Tensor:  # fmt: skip
        need_h, need_w, need_b = need
        n = hidden.shape[0]
        loss = torch.zeros((), dtype=torch.promote_types(weight.dtype, torch.float32), device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        acc = torch.promote_types(weight.dtype, torch.float32)  # Note [Head gradient precision]
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        tiles = range(0, n, tokens)
        for k, a in enumerate(tiles):
            rows = slice(a, min(n, a + tokens))
            x = hidden[rows]
            tile_loss, g, valid = _tile(x, labels[rows], weight, bias, ignore_index)
            loss += tile_loss
            if grad_h is not None:
                grad_h[rows] = (g @ weight).mul_(valid)
            if grad_w is not None:
                x = x * valid  # rows without a target add nothing (Note [Fewest passes over the logits])
                if g.dtype == x.dtype == grad_w.dtype:
                    grad_w.addmm_(g.t(), x)
                else:
                    grad_w += g.t() @ x  # rounded once to the compute dtype per tile (Note [Head gradient precision])
            if grad_b is not None:
                grad_b += g.t() @ valid.to(g.dtype).squeeze(1)
            del g, tile_loss, valid, x
            if progress is not None:
                progress(f"forward tile {k + 1}/{len(tiles)}")
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.has = (grad_h is not None, grad_w is not None, grad_b is not None)
        ctx.save_for_backward(*(t for t in (grad_h, grad_w, grad_b) if t is not None))
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        saved = iter(ctx.saved_tensors)
        grad_h, grad_w, grad_b = (next(saved) if has else None for has in ctx.has)
        w_dtype, b_dtype = ctx.dtypes
        out_h = grad_h * grad_loss if grad_h is not None else None
        out_w = _scaled(grad_w, grad_loss, w_dtype) if grad_w is not None else None
        out_b = _scaled(grad_b, grad_loss, b_dtype) if grad_b is not None else None
        return out_h, out_w, out_b, None, None, None, None, None


def _scaled(acc: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``acc * scale`` computed in ``acc``'s dtype and written in ``dtype``: one pass and one rounding, no
    temporary of ``acc``'s size (the saved accumulator stays as it is, for a backward with retain_graph)."""
    return torch.mul(acc, scale, out=torch.empty(acc.shape, dtype=dtype, device=acc.device))
