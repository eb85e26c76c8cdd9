"""The runtime side of rebuilds (Notes [Recompute or swap], [Batch norm rebuilds], swap.planning.recompute):
saved outputs of GELU/SiLU/leaky ReLU, and of training-mode batch norm (and a ReLU on it), are not packed;
autograd keeps a ``Recomputed`` handle, and the output is rebuilt from the packed input at its backward use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..planning.recompute import Rule, producer, rebuild_of


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
        self._ours: set[int] = set()  # Note [Whose saved input]
        self.rebuilt = 0

    # Note [Whose saved input]
    # Finding a candidate's source means reading its producer's saved input, which runs that saved tensor's
    # unpack hook. Ours answers the peek without moving anything; another's may not: a node made inside a
    # checkpoint nested in our hooks (a user's ``torch.utils.checkpoint``, one of our recompute regions) saved
    # its input through the checkpoint's hooks, whose unpack reruns the whole checkpointed module, in the
    # forward, and reads the checkpoint's own inputs through our hooks while we are peeking (a crash). So every
    # tensor our hooks save is told to us (``pack``, or ``saving`` for those the manager keeps), and we
    # remember the autograd sequence number at that moment: a node saves its tensors right after it is made,
    # when the thread's counter is its own ``_sequence_nr() + 1``. A candidate whose node never saved through
    # us is declined before any of its saved tensors (its input, its weight, its running statistics) is read.
    # Sequence numbers are per thread; a forward that builds its graph on several threads could mistake one
    # node for another, which is then caught as before: the peek finds no handle of ours and declines.
    _REMEMBERED = 1 << 16  # sequence numbers kept; a candidate saved later than that after its node is declined

    def saving(self) -> None:
        """Our pack hook is saving a tensor (``pack`` calls it; Note [Whose saved input])."""
        seq = torch._C._autograd._get_sequence_nr()
        self._ours.add(seq)
        if len(self._ours) > self._REMEMBERED:
            self._ours = {s for s in self._ours if s > seq - self._REMEMBERED // 2}

    def _saved_through_us(self, node: Any) -> bool:
        return node._sequence_nr() + 1 in self._ours  # Note [Whose saved input]

    def pack(self, t: torch.Tensor) -> Optional[Recomputed]:
        """Called for every tensor our hooks save (the manager calls ``saving`` for those it does not offer)."""
        self.saving()
        root, node = producer(t)
        if node is None or root.requires_grad is False:
            return None
        how = rebuild_of(node, self._saved_through_us)
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
        return torch.empty(0, dtype=packed.dtype, device=out.device).set_(
            out.untyped_storage(), packed.offset, packed.size, packed.stride
        )

