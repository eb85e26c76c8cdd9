"""How many tokens one tile of a language model's head and loss may hold, from a budget (pure).

Note [Tiled head and loss]
At a 50k vocabulary the logits (tokens × vocab in the model's dtype), their fp32 copy for the loss and the
loss's fp32 buffers are the largest tensors of a GPT's training step. Tiled along tokens, the head
(``hidden @ W.T + b``) and the cross-entropy run on ``t`` tokens at a time, and each tile's gradients are
taken at once (Note [Gradients in the forward]), so no tile's logits outlive it. A tile holds, at its peak,
its logits upcast to fp32 and their softmax (fp32; float64 for a float64 head), besides two tokens × hidden
temporaries: ``t · (2 · vocab · max(4, itemsize) + 2 · hidden · itemsize)`` bytes (``tile_bytes``; Note
[Fewest passes over the logits] in swap/tiling/run/linear_ce.py). Besides the tiles, the head holds
(``fixed_bytes``) the hidden states and their gradient (in backward: the saved gradient and the scaled one
it returns, the hidden states freed unless the caller keeps them), the weight's gradient accumulated in
fp32 (Note [Head gradient precision] in swap/tiling/run/linear_ce.py) and, in the weight's dtype, one
tile's product for it in forward, or the gradient returned in backward.

Note [Gradients in the forward]
The loss is a scalar, so the gradients of its sum with respect to the hidden states and the head's weight
and bias are known in the forward, up to the incoming scalar: per tile, dL/dlogits = softmax - onehot (zero
on ignored rows), grad_hidden[tile] = dL/dlogits @ W, grad_W += dL/dlogits^T @ hidden[tile] (as fused
linear-cross-entropy kernels do, e.g. Liger's). The forward keeps grad_hidden (the hidden states' size) and
grad_W (the weight's size) as saved tensors instead of the hidden states; the backward only scales them by
the incoming gradient. The head's matmuls run once per step (three products a tile, against four with the
logits recomputed in backward) and the hidden states need not be kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...units import fmt_bytes


class HeadInfeasible(ValueError):
    """Even one token per tile does not fit: ``working_set`` is what the head needs at one token a tile."""

    def __init__(self, message: str, working_set: int, budget: int) -> None:
        super().__init__(message)
        self.op, self.working_set, self.budget = "lm_head + cross_entropy", working_set, budget


@dataclass(frozen=True)
class HeadShape:
    """The head's operands: ``tokens`` rows of ``hidden`` features into ``vocab`` logits of ``itemsize``
    bytes each (the dtype the head computes in; the loss computes in fp32)."""

    tokens: int
    hidden: int
    vocab: int
    itemsize: int = 4

    def tile_bytes(self, t: int) -> int:
        """One tile of ``t`` tokens at its peak (Note [Tiled head and loss])."""
        return t * (2 * self.vocab * max(4, self.itemsize) + 2 * self.hidden * self.itemsize)

    def fixed_bytes(self) -> int:
        """The hidden states and their gradient, the weight gradient's fp32 accumulator and one weight-sized
        tensor in the weight's dtype (Note [Tiled head and loss])."""
        states = 2 * self.tokens * self.hidden * self.itemsize
        return states + self.vocab * self.hidden * (max(4, self.itemsize) + self.itemsize)

    def untiled_bytes(self) -> int:
        """The head in one tile: every token's logits at once."""
        return self.fixed_bytes() + self.tile_bytes(self.tokens)


def tokens_per_tile(shape: HeadShape, budget: int) -> int:
    """The most tokens a tile may hold so that the head and loss stay within ``budget`` bytes (all tokens
    when the untiled head fits). Raises ``HeadInfeasible`` when one token a tile does not fit."""
    room = budget - shape.fixed_bytes()
    per_token = shape.tile_bytes(1)
    if room < per_token:
        need = shape.fixed_bytes() + per_token
        states = 2 * shape.tokens * shape.hidden * shape.itemsize
        weight = shape.fixed_bytes() - states  # the fp32 accumulator and one tensor in the weight's dtype
        raise HeadInfeasible(
            f"cannot tile lm_head + cross_entropy under {fmt_bytes(budget)}: at one token a tile it needs "
            f"{fmt_bytes(need)} (hidden states and their gradient {fmt_bytes(states)}, the head's weight gradient "
            f"(fp32, and in the weight's dtype) {fmt_bytes(weight)}, one token's logits and loss buffers "
            f"{fmt_bytes(per_token)}). Raise the budget or lower the batch or sequence length.",
            need, budget,
        )  # fmt: skip
    return max(1, min(shape.tokens, room // per_token))
