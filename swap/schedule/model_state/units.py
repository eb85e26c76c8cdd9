"""Which FSDP2 units a rank offloads to the host, by a byte budget (Note [Model state under FSDP2] in
swap/runtime/model_state/fsdp2.py). Pure: the runtime applies the choice, the forecast prices it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from .plan import Placement
from .policy import ModelStatePolicy


def blocks_of(paths: Sequence[str]) -> list[str]:
    """The blocks FSDP2 shards by default among module ``paths`` (those holding parameters): the outermost
    repeated children of containers, a path ending in an index (as Note [Candidate regions] in swap/joint/ops.py
    finds blocks)."""
    indexed = [p for p in paths if p and p.rsplit(".", 1)[-1].isdigit()]
    return [p for p in indexed if not any(p != q and p.startswith(q + ".") for q in indexed)]


def shard_of(shape: Sequence[int], itemsize: int, world_size: int) -> int:
    """Bytes of one rank's shard of a parameter of ``shape``: dim 0 padded to a multiple of the world size."""
    if not shape:
        return itemsize
    return math.ceil(shape[0] / world_size) * math.prod(shape[1:]) * itemsize


def choose_offloaded(units: Sequence[tuple[str, int]], room: int) -> dict[str, Placement]:
    """Placements for ``units`` (path, the rank's model-state bytes of that unit: shard, gradient and optimizer
    state), given in forward order, the root ("") among them, so that the resident ones' bytes fit ``room``:
    units are offloaded (``STREAMED``: FSDP2 copies the shard in before each all-gather) from the last in the
    forward order backwards, the root last of all. Every unit is offloaded when even that does not fit; the
    caller says so."""
    order = [u for u in reversed(units) if u[0]] + [u for u in units if not u[0]]
    resident = sum(b for _, b in units)
    placements = {path: Placement.RESIDENT for path, _ in units}
    for path, nbytes in order:
        if resident <= room:
            break
        placements[path] = Placement.STREAMED
        resident -= nbytes
    return placements


@dataclass
class ShardPlan:
    """What ``shard`` did: each unit's path ("" for the root) and placement, in forward (module) order, the
    rank's model-state bytes per unit it was chosen on, and the policy it was made by (its ``host_threads`` are
    the host steps')."""

    placements: dict[str, Placement]
    model_state: dict[str, int]
    policy: Optional[ModelStatePolicy] = None

    @property
    def offloaded(self) -> list[str]:
        return [u for u, p in self.placements.items() if p is Placement.STREAMED]

    def resident_bytes(self) -> int:
        return sum(b for u, b in self.model_state.items() if self.placements[u] is Placement.RESIDENT)
