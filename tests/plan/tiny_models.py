"""Small models for the planner's tests: built in milliseconds, captured in a fraction of a second."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from swap.capture import ALLOC, FREE, Trace

SIDE = 16  # image side


class TinyCNN(nn.Module):
    def __init__(self, width: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        )  # fmt: skip
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


def cnn_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, SIDE, SIDE), torch.randint(0, 5, (n,))


class Attention(nn.Module):
    """One self-attention layer through scaled_dot_product_attention, then a classifier over the tokens."""

    def __init__(self, d: int = 32, heads: int = 4, dropout: float = 0.0, classes: int = 7) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, 2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def attention_batch(n: int, t: int = 64, d: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, t, d), torch.randint(0, 7, (n, t))


class Contrastive(nn.Module):
    """An n x n similarity matrix: memory quadratic in the batch (the trace is not linear in it)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.proj(x)
        return z @ z.t()


def contrastive_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    sim = model(batch)
    return F.cross_entropy(sim, torch.arange(sim.shape[0], device=sim.device))


def contrastive_batch(n: int) -> torch.Tensor:
    return torch.randn(n, 64)


def assert_balanced(t: Trace) -> dict[int, int]:
    """Every free matches a live allocation of the same size; returns what is still alive (id -> bytes)."""
    alive: dict[int, int] = {}
    for o, i, s in zip(t.op.tolist(), t.id.tolist(), t.size.tolist()):
        if o == ALLOC:
            assert i not in alive
            alive[i] = s
        elif o == FREE:
            assert alive.pop(i) == s
    return alive
