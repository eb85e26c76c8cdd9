"""Activation checkpointing as a user writes it by hand, for the benchmarks that compare against it
(bench/joint_cpu.py, bench/plan_vs_reality_time.py and, through it, bench/recompute_price.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint


class Checkpointed(nn.Module):
    """``inner`` run under non-reentrant activation checkpointing; its attributes stay reachable (the U-Net's
    forward reads ``up_block.resnets``)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)


def checkpoint_blocks(blocks: Iterable[tuple[nn.Module, str]]) -> None:
    """Puts each block, given as (parent module, attribute name), under ``Checkpointed`` in place. Its
    parameters and buffers keep their order in ``model.parameters()``; their names gain ``.inner``."""
    for parent, name in blocks:
        setattr(parent, name, Checkpointed(getattr(parent, name)))


def blocks_at(model: nn.Module, paths: Iterable[str]) -> list[tuple[nn.Module, str]]:
    """(parent module, attribute name) of each module path of ``model`` ("blocks.3" -> (model.blocks, "3"))."""
    out = []
    for path in paths:
        parent, _, name = path.rpartition(".")
        out.append((model.get_submodule(parent), name))
    return out
