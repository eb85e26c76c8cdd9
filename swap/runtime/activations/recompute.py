"""The runtime side of rebuilds (Notes [Recompute or swap], [Batch norm rebuilds], swap.joint.recompute):
saved outputs of GELU/SiLU/leaky ReLU, and of training-mode batch norm (and a ReLU on it), are not packed;
autograd keeps a ``Recomputed`` handle, and the output is rebuilt from the packed input at its backward use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ...joint.recompute import Rule, SavedThrough, producer, rebuild_of


@dataclass
class Recomputed:
    """What autograd stores in place of an eligible saved tensor."""

    rule: Rule
    source: Any  # the input's packed handle (or the input itself, if it is not swapped)
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class RecomputeHooks:
    """The runtime side: ``pack`` returns a ``Recomputed`` handle or None (swap it as usual); ``unpack``
    rebuilds. ``intercepts(packed)`` says whether an unpack is ours (a handle, or the peek at a saved input)."""

    def __init__(self) -> None:
        self._peeking = False
        self._peeked: Any = None
        self._ours = SavedThrough()  # Note [Whose saved input]
        self.rebuilt = 0  # rebuilds run (one per backward use)
        self.rebuilt_bytes = 0  # bytes they produced: made on the device instead of moved over the link

    def saving(self) -> None:
        """Our pack hook is saving a tensor (``pack`` calls it; Note [Whose saved input])."""
        self._ours.saving()

    def pack(self, t: torch.Tensor) -> Optional[Recomputed]:
        """Called for every tensor our hooks save (the manager calls ``saving`` for those it does not offer)."""
        self.saving()
        root, node = producer(t)
        if node is None or root.requires_grad is False:
            return None
        how = rebuild_of(node, self._ours)
        if how is None:
            return None
        self._peeking, self._peeked = True, None
        try:
            _ = getattr(how.node, how.attribute)  # unpacks through our hook: see intercepts()/unpack()
        finally:
            self._peeking = False
        source, self._peeked = self._peeked, None
        if source is None or isinstance(source, Recomputed):
            return None  # Note [No rebuild from a rebuild]
        return Recomputed(how.rule, source, t.dtype, t.size(), t.stride(), t.storage_offset())

    def intercepts(self, packed: Any) -> bool:
        return self._peeking or isinstance(packed, Recomputed)

    def unpack(self, packed: Any, unpack: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        if self._peeking:  # the node's saved input, read at pack time: remember its handle, move nothing
            self._peeked = packed
            return torch.empty(0)
        x = unpack(packed.source) if not isinstance(packed.source, torch.Tensor) else packed.source
        with torch.no_grad():
            out = packed.rule(x)
        self.rebuilt += 1
        self.rebuilt_bytes += out.untyped_storage().nbytes()
        return torch.empty(0, dtype=packed.dtype, device=out.device).set_(
            out.untyped_storage(), packed.offset, packed.size, packed.stride
        )

