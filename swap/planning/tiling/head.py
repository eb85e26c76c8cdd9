"""How many tokens one tile of a language model's head and loss may hold, from a budget (pure).

Note [Tiled head and loss]
At a 50k vocabulary the logits (tokens × vocab in the model's dtype), their fp32 copy for the loss and the
loss's fp32 buffers are the largest tensors of a GPT's training step. Tiled along tokens, the head
(``hidden @ W.T + b``) and the cross-entropy run on ``t`` tokens at a time: forward keeps only the hidden
states (the boundary) and adds each tile's summed loss into one scalar; backward recomputes each tile's
logits from its hidden slice, takes them back to the hidden slice and the head's weight, and frees them
before the next tile. A tile holds, at its peak in backward, its logits in the model's dtype, their fp32
upcast, the fp32 log-softmax autograd saves, the fp32 gradient of the upcast and the gradient of the logits
in the model's dtype: ``t · vocab · (2 · itemsize + 12)`` bytes (``tile_bytes``). Besides the tiles, the
head holds the hidden states, their gradient and the weight's gradient accumulator (``fixed_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..budget import fmt_bytes


class HeadInfeasible(ValueError):
    """Even one token per tile does not fit: ``working_set`` is what the head needs at one token a tile."""

    def __init__(self, message: str, working_set: int, budget: int) -> None:
        super().__init__(message)
        self.op, self.working_set, self.budget = "lm_head + cross_entropy", working_set, budget


@dataclass(frozen=True)
class HeadShape:
    """The head's operands: ``tokens`` rows of ``hidden`` features into ``vocab`` logits of ``itemsize``
    bytes each (the model's dtype; the loss computes in fp32)."""

    tokens: int
    hidden: int
    vocab: int
    itemsize: int = 4

    def tile_bytes(self, t: int) -> int:
        """One tile of ``t`` tokens at its backward peak (Note [Tiled head and loss])."""
        return t * self.vocab * (2 * self.itemsize + 12)

    def fixed_bytes(self) -> int:
        """The hidden states, their gradient, the weight gradient's accumulator."""
        return (2 * self.tokens * self.hidden + self.vocab * self.hidden) * self.itemsize

    def untiled_bytes(self) -> int:
        """The same step untiled: every token's logits and loss buffers at once."""
        return self.fixed_bytes() + self.tile_bytes(self.tokens)


def tokens_per_tile(shape: HeadShape, budget: int) -> int:
    """The most tokens a tile may hold so that the head and loss stay within ``budget`` bytes (all tokens
    when the untiled head fits). Raises ``HeadInfeasible`` when one token a tile does not fit."""
    room = budget - shape.fixed_bytes()
    per_token = shape.tile_bytes(1)
    if room < per_token:
        need = shape.fixed_bytes() + per_token
        states, weight = 2 * shape.tokens * shape.hidden * shape.itemsize, shape.vocab * shape.hidden * shape.itemsize
        raise HeadInfeasible(
            f"cannot tile lm_head + cross_entropy under {fmt_bytes(budget)}: at one token a tile it needs "
            f"{fmt_bytes(need)} (hidden states and their gradient {fmt_bytes(states)}, the head's weight gradient "
            f"{fmt_bytes(weight)}, one token's logits and loss buffers "
            f"{fmt_bytes(per_token)}). Raise the budget or lower the batch or sequence length.",
            need, budget,
        )  # fmt: skip
    return max(1, min(shape.tokens, room // per_token))
