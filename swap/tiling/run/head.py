"""A language model's head and cross-entropy run tile by tile along tokens (Note [Tiled head and loss] in
swap/tiling/plan/head.py), their gradients taken in the forward; and ``TiledCausalLM``, which does it
for a Hugging Face causal LM without changing the model."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..plan.head import HeadShape, tokens_per_tile
from .linear_ce import LinearCrossEntropy
from .progress import Progress, progress_sink

IGNORE_INDEX = -100  # what PyTorch's and Hugging Face's losses skip


def tiled_cross_entropy(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, tokens: int,
                        ignore_index: int = IGNORE_INDEX, progress: Progress = False) -> torch.Tensor:  # fmt: skip
    """``F.cross_entropy(head(hidden).float(), labels, reduction="sum")`` over ``tokens`` rows at a time:
    the logits of all rows never exist at once, and each tile's gradients are taken in the forward, so the
    backward recomputes nothing (Note [Tiled head and loss], Note [Gradients in the forward]).

    Args:
        hidden: (N, H) or (..., H) hidden states (flattened to rows).
        head: the output projection (its weight may be tied to the input embedding).
        labels: one class index per row, ``ignore_index`` where a row has no target.
        tokens: rows per tile.
    Returns: the summed loss (fp32 scalar); divide by the number of counted rows for the mean. Not twice
    differentiable.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(h.device)
    if y.shape[0] != h.shape[0]:
        raise ValueError(f"{h.shape[0]} hidden rows but {y.shape[0]} labels: give one label per token")
    if tokens < 1:
        raise ValueError(f"tokens per tile must be at least 1 (got {tokens})")
    weight, bias = head.weight, head.bias
    if h.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden states have {h.shape[-1]} features but the head takes {weight.shape[1]}")
    _check_labels(y, weight.shape[0], ignore_index)
    grad = torch.is_grad_enabled()
    need = (grad and h.requires_grad, grad and weight.requires_grad, grad and bias is not None and bias.requires_grad)
    return LinearCrossEntropy.apply(h, weight, bias, y, tokens, ignore_index, need,
                                    progress_sink(progress, "swap.tiled head"))


def _check_labels(y: torch.Tensor, vocab: int, ignore_index: int, synchronous: Optional[bool] = None) -> None:
    """A label outside the vocabulary would index past a tile's logits: say which, before any tile runs.

    ``synchronous`` (default: off CUDA) reads the answer on the host, to name the first bad label and its
    row. On a GPU that read would make the host wait for the device in every forward, so the check is queued
    on the device instead (``torch._assert_async``): a bad label fails there, with this message, at the next
    synchronisation. The meta device has no values to check."""
    if y.device.type == "meta" or y.numel() == 0:
        return
    if y.is_floating_point():
        raise TypeError(f"labels must be class indices (an integer tensor), got {y.dtype}")
    bad = (y != ignore_index) & ((y < 0) | (y >= vocab))
    use = f"use class indices below {vocab}, or {ignore_index} (ignore_index) for rows without a target"
    if synchronous is None:
        synchronous = y.device.type != "cuda"
    if not synchronous:
        torch._assert_async(torch.logical_not(bad.any()), f"a label is outside the vocabulary [0, {vocab}): {use}")
        return
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise ValueError(f"label {int(y[first])} at row {first} is outside the vocabulary [0, {vocab}): {use}")


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is what ``TiledCausalLM`` tiles: a linear head (``get_output_embeddings()``) on a
    ``base_model`` of its own."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return isinstance(head, nn.Linear) and getattr(model, "base_model", model) is not model


class TiledCausalLM(nn.Module):
    """A Hugging Face causal LM (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ...) whose head and loss run
    tiled along tokens when it is called with ``labels``; without labels it is the model itself.

    The decoder runs as the model's ``base_model``; the loss is Hugging Face's (labels shifted by one, the
    mean over labels that are not -100, or the sum over ``num_items_in_batch`` when given) and ``logits`` is
    None in the output: the point is never to hold them. ``budget`` (bytes for the head and loss) sets the
    tokens per tile (``swap.tiling.plan.head.tokens_per_tile``), or ``tokens`` does."""

    def __init__(self, model: nn.Module, budget: Optional[int] = None, tokens: Optional[int] = None,
                 progress: Progress = False) -> None:  # fmt: skip
        super().__init__()
        if not is_causal_lm(model):
            raise TypeError(f"{type(model).__name__} is not a causal LM with a linear head on a base model "
                            "(get_output_embeddings() and base_model): use swap.tiled_cross_entropy")  # fmt: skip
        config = getattr(model, "config", None)
        for knob in ("final_logit_softcapping", "logit_scale"):
            if getattr(config, knob, None):
                raise ValueError(f"{type(model).__name__} transforms its logits ({knob}={getattr(config, knob)}), "
                                 "which the tiled head does not reproduce; use swap.tiled_cross_entropy")  # fmt: skip
        if budget is None and tokens is None:
            raise ValueError("give budget= (bytes for the head and loss) or tokens= (tokens per tile)")
        head = model.get_output_embeddings()
        self.model, self.head, self.budget, self.tokens, self.progress = model, head, budget, tokens, progress
        self.last_tokens: Optional[int] = None

    def tokens_for(self, rows: int, hidden: int, dtype: torch.dtype) -> int:
        """Tokens per tile for ``rows`` tokens of ``hidden`` features in ``dtype`` (or autocast's)."""
        if self.tokens is not None:
            return self.tokens
        if dtype == torch.float32 and torch.is_autocast_enabled(self.head.weight.device.type):
            dtype = torch.get_autocast_dtype(self.head.weight.device.type)  # the head's logits come out in it
        itemsize = dtype.itemsize
        return tokens_per_tile(HeadShape(rows, hidden, self.head.out_features, itemsize), self.budget)

    def forward(self, input_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                num_items_in_batch: Optional[Any] = None, **kwargs: Any) -> Any:  # fmt: skip
        if labels is None:
            return self.model(input_ids=input_ids, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        kwargs.pop("return_dict", None)
        out = self.model.base_model(input_ids=input_ids, return_dict=True, **kwargs)
        h = out.last_hidden_state[:, :-1]
        y = labels[:, 1:].to(h.device)
        rows = h.shape[0] * h.shape[1]
        self.last_tokens = self.tokens_for(rows, h.shape[-1], h.dtype)
        total = tiled_cross_entropy(h, self.head, y, self.last_tokens, progress=self.progress)
        count = num_items_in_batch if num_items_in_batch is not None else (y != IGNORE_INDEX).sum()
        loss = total / count
        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=getattr(out, "past_key_values", None),
                                      hidden_states=getattr(out, "hidden_states", None),
                                      attentions=getattr(out, "attentions", None))  # fmt: skip
