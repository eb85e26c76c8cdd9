"""The bytes an operator call moves on the roofline, as the capture counts them (pure).

Note [Indexed operators move what they index]
An operator's bytes on the roofline are its inputs' and outputs' sizes. An operator that touches a tensor
only at indexed positions moves far less: ``gather`` reads as many source elements as its output holds, an
in-place ``scatter_`` / ``scatter_add_`` writes (or reads, adds and writes) as many elements of ``self`` as
``index`` holds. Counted whole, gathering one column of a tokens × vocab tile would cost a full pass over
the tile (the tiled LM head gathers three columns a tile and scatters one: Note [Fewest passes over the
logits] in swap/tiling/run/linear_ce.py).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten

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


def moved_bytes(func: Any, args: tuple, kwargs: dict, out: Any, outputs: Optional[list[torch.Tensor]] = None) -> int:
    """Bytes ``func(*args, **kwargs)`` (which returned ``out``) moves, as the capture prices every operator:
    its tensor arguments, the tensors it writes without returning them, and its ``outputs`` (default: every
    tensor in ``out``; the capture passes those on the meta device); an indexed operator's ``indexed_bytes``
    instead (Note [Indexed operators move what they index])."""
    indexed = indexed_bytes(func, args, kwargs, out)
    if indexed is not None:
        return indexed
    if outputs is None:
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    return sum(_nbytes(t) for t in (*inputs, *_written_without_return(func, args, kwargs), *outputs))


def _written_without_return(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an operator writes in place without returning them (the in-place foreach kernels
    optimizers use on CUDA return nothing). Their writes are memory traffic like the returned ``self`` of an
    ordinary in-place operator, which the bytes moved count as an output; without this a foreach optimizer
    step would count only its reads."""
    schema = getattr(func, "_schema", None)
    if schema is None or schema.returns:
        return []
    out: list[torch.Tensor] = []
    for k, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[k] if k < len(args) else kwargs.get(a.name)
            out.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return out
