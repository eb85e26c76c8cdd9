"""The bytes an operator that reads or writes only indexed positions moves (pure).

Note [Indexed operators move what they index]
An operator's bytes on the roofline are its inputs' and outputs' sizes. An operator that touches a tensor
only at indexed positions moves far less: ``gather`` reads as many source elements as its output holds, an
in-place ``scatter_`` / ``scatter_add_`` writes (or reads, adds and writes) as many elements of ``self`` as
``index`` holds. Counted whole, gathering one column of a tokens × vocab tile would cost a full pass over
the tile (the tiled LM head gathers three columns a tile and scatters one: Note [Fewest passes over the
logits] in swap/runtime/tiling/linear_ce.py).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

aten = torch.ops.aten

_GATHER = {aten.gather.default}
_SCATTER_WRITE = {aten.scatter_.src, aten.scatter_.value}
_SCATTER_UPDATE = {aten.scatter_add_.default, aten.scatter_reduce_.two}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def indexed_bytes(func: Any, args: tuple, kwargs: dict, out: Any) -> Optional[int]:
    """Bytes moved by ``func(*args, **kwargs)`` (which returned ``out``) when it is a gather or an in-place
    scatter (Note [Indexed operators move what they index]); None for any other operator."""
    if func in _GATHER:
        source, index = args[0], args[2] if len(args) > 2 else kwargs["index"]
        return _nbytes(index) + out.numel() * (source.element_size() + out.element_size())
    if func in _SCATTER_WRITE or func in _SCATTER_UPDATE:
        target, index = args[0], args[2] if len(args) > 2 else kwargs["index"]
        src = args[3] if len(args) > 3 else kwargs.get("src")
        read_src = index.numel() * src.element_size() if isinstance(src, torch.Tensor) else 0
        touches = 2 if func in _SCATTER_UPDATE else 1
        return _nbytes(index) + read_src + touches * index.numel() * target.element_size()
    return None
