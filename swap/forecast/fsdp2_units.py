"""A model as FSDP2 shards it over its ranks: the ``fully_shard`` units (each block and the root), each one's
unsharded and per-rank bytes, the interconnect the collectives run on, and model-state offload where the rank
keeps its model state on the host (Note [One rank of FSDP2] in swap/forecast/distributed.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from ..devices import InterconnectProfile, interconnect
from ..joint.ops import nested
from ..schedule.model_state.units import blocks_of, shard_of
from .fsdp2_lanes import Offload


@dataclass(frozen=True)
class Unit:
    """One ``fully_shard`` unit: its module path ("" for the root), unsharded and shard bytes of its parameters."""

    path: str
    param_bytes: int
    shard_bytes: int


@dataclass(frozen=True)
class Fsdp2:
    """A model as FSDP2 shards it over ``world_size`` ranks: its units (forward order unknown until a trace is
    read), each parameter's (bytes, shard bytes, unit path) in ``model.parameters()`` order, and the interconnect."""

    world_size: int
    units: tuple[Unit, ...]
    params: tuple[tuple[int, int, str], ...]
    link: InterconnectProfile
    offload: Optional[Offload] = None  # model state on the host (Note [Model-state offload on one rank])
    itemsize: int = 4  # bytes of a parameter as captured

    def shard_numel(self) -> dict[str, int]:
        """Each unit's parameters in one rank's shard, in forward (module) order."""
        return {u.path: u.shard_bytes // self.itemsize for u in self.units}

    @property
    def shard_bytes(self) -> int:
        return sum(u.shard_bytes for u in self.units)

    def describe(self) -> str:
        blocks = [u for u in self.units if u.path]
        largest = max((u.param_bytes for u in self.units), default=0)
        return (f"FSDP2 over {self.world_size} ranks on {self.link.name}: {len(blocks)} blocks and the root, "
                f"{self.shard_bytes / 2**30:.2f} GiB of parameters per rank, largest unit {largest / 2**30:.2f} GiB "
                "unsharded")  # fmt: skip


def default_units(model: torch.nn.Module) -> list[str]:
    """The blocks to shard by default (swap.schedule.model_state.units.blocks_of)."""
    return blocks_of([n for n, m in model.named_modules() if any(True for _ in m.parameters())])


def fsdp2(model_fn: Callable[[], torch.nn.Module], world_size: int, link: Union[str, InterconnectProfile] = "nvlink4",
          dtype: Optional[torch.dtype] = None, units: Optional[list[str]] = None,
          offload: Optional[Offload] = None) -> Fsdp2:  # fmt: skip
    """``model_fn``'s model (built on the meta device, cast to ``dtype``) sharded by FSDP2 over ``world_size``
    ranks, each of ``units`` (default ``default_units``) and the root a ``fully_shard`` unit; ``offload``: their
    model state on the host (Note [Model-state offload on one rank])."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, not {world_size!r}")
    with torch.device("meta"):
        model = model_fn()
    if dtype is not None:
        model = model.to(dtype)
    paths = default_units(model) if units is None else list(units)
    named = dict(model.named_modules())
    missing = [p for p in paths if p not in named]
    if missing:
        raise ValueError(f"no module at {', '.join(missing)}: units are module paths such as "
                         f"{', '.join(default_units(model)[:2]) or 'layers.0'}")  # fmt: skip
    by_length = sorted(paths, key=len, reverse=True)
    params, itemsize = [], 4
    for name, p in model.named_parameters():
        itemsize = p.element_size()
        unit = next((u for u in by_length if nested(name, u)), "")
        params.append((p.numel() * p.element_size(), shard_of(tuple(p.shape), p.element_size(), world_size), unit))
    totals: dict[str, list[int]] = {u: [0, 0] for u in ["", *paths]}
    for nbytes, shard, unit in params:
        totals[unit][0] += nbytes
        totals[unit][1] += shard
    net = link if isinstance(link, InterconnectProfile) else interconnect(link)
    return Fsdp2(world_size, tuple(Unit(u, *totals[u]) for u in ["", *paths]), tuple(params), net, offload, itemsize)
