"""The tiled-execution engine: one autograd function that runs any per-tile computation tile by tile.

Note [Tiled autograd]
Forward runs each tile without gradients and writes its output into a slice of one preallocated output
(spatial tiles); only the input is saved, as
the boundary of the segment (``ctx.save_for_backward``, so the swap runtime's saved-tensor hooks see it and
may send it to the host). Backward goes tile by tile: the tile is recomputed from its slice of the input
(a view, its halo included) with gradients, ``torch.autograd.grad`` takes it back to the tile's input and
the parameters, the input-gradient slice is added into one preallocated input gradient (halos overlap:
neighbouring tiles' contributions sum there) and the parameter gradients into one accumulator each; then
the tile's tensors are dropped before the next tile. The parameters are inputs of the function, so autograd
hands their gradients on as for any operator (hooks, DDP, accumulation into ``.grad``).

Note [Backward halo]
SFT (segmented fused-tiled execution) computes each layer's gradient tile from a gradient tile with a halo (its Fig. 7:
a 64-wide output tile needs 66-wide forward tiles). Here the recompute reaches further instead: a tile is recomputed
over the whole receptive field of its *output* slice, and autograd runs back through that recomputed region. Every
output element belongs to exactly one tile, so each tile contributes exactly the terms dL/dy·dy/dx of
its own outputs; the elements in the overlapping halos are recomputed by several tiles but each tile only
propagates its own outputs' gradients, so summing the input-gradient tiles, and the parameter gradients
over tiles, is the untiled gradient. Only the order of the sums differs (Note [Tiled gradient tolerance] in
tests/swap/tiling/test_tiled_spatial.py).

Note [Recompute under the forward's autocast]
Backward runs outside the user's ``torch.autocast`` region, so a recompute there would run in full precision
and take the gradient of another function than the forward computed. Forward records the autocast state of
its input's device and backward recomputes under the same, as ``torch.utils.checkpoint`` does.

Note [Recompute is not swapped]
The recompute runs under identity saved-tensor hooks: a tile's activations live for one tile only, so a
swap runtime around the training step must not see (and try to move) them; it sees the segment boundaries.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .staging import Staging

Index = tuple[slice, ...]


@dataclass
class Tile:
    """One tile: ``src`` indexes the input (a view, halo included), ``dst`` the output, ``arg`` is what the
    per-tile computation needs besides. (The LM head's token tiles do not use this engine: Note [Gradients
    in the forward] in swap/tiling/plan/head.py.)"""

    src: Index
    dst: Index
    arg: Any = None


class Tiling:
    """A per-tile computation and its tiles.

    ``run(x_tile, tile) -> y_tile`` computes one tile (the same operators as the untiled computation, on the
    tile); ``output(x) -> tensor`` allocates the whole output; ``params`` are the
    tensors ``run`` reads that need gradients; ``copy_input`` says to copy a tile's input slice before
    ``run`` (its first operator writes in place); ``device`` is where tiles compute when the input is
    elsewhere (Note [Host inputs] in swap/tiling/plan/cost.py: each tile's slice is copied there, and
    its input gradient copied back, through ``staging``: Note [Staged host tiles] in
    swap/tiling/run/staging.py; by default buffers of this Tiling's own)."""

    def __init__(self, run: Callable[[torch.Tensor, Tile], torch.Tensor], tiles: Sequence[Tile],
                 output: Callable[[torch.Tensor], torch.Tensor], params: Sequence[torch.Tensor] = (),
                 copy_input: bool = False, progress: Optional[Callable[[str], None]] = None,
                 device: Optional[torch.device] = None, staging: Optional[Staging] = None) -> None:  # fmt: skip
        self.run, self.tiles, self.output = run, list(tiles), output
        self.params = [p for p in params if p.requires_grad]
        self.copy_input = copy_input
        self.progress = progress
        self.device = device
        self._staging = staging

    def moves(self, x: torch.Tensor) -> bool:
        """Whether tiles of ``x`` are copied to another device to compute."""
        return self.device is not None and x.device != self.device

    @property
    def staging(self) -> Staging:
        """The pinned buffers host tiles pass through (Note [Staged host tiles])."""
        if self._staging is None:
            self._staging = Staging(self.device)
        return self._staging

    def tile_input(self, x: torch.Tensor, tile: Tile) -> torch.Tensor:
        t = x[tile.src]
        if self.moves(x):
            return self.staging.to_device(t)  # a copy: in-place first operators may write it
        return t.clone() if self.copy_input else t

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return TiledFunction.apply(self, x, *self.params)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _autocast_state(device_type: str) -> Optional[dict[str, Any]]:
    """``torch.autocast``'s arguments that reproduce the autocast state now on ``device_type`` (None: the
    device type has no autocast, e.g. meta)."""
    if not torch.amp.is_autocast_available(device_type):
        return None
    return {"enabled": torch.is_autocast_enabled(device_type), "dtype": torch.get_autocast_dtype(device_type),
            "cache_enabled": torch.is_autocast_cache_enabled()}  # fmt: skip


def _recompute_autocast(device_type: str, state: Optional[dict[str, Any]]) -> Any:
    return torch.autocast(device_type, **state) if state is not None else contextlib.nullcontext()


class TiledFunction(torch.autograd.Function):
    """Note [Tiled autograd]."""

    @staticmethod
    def forward(ctx: Any, tiling: Tiling, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.tiling = tiling
        ctx.autocast = _autocast_state(x.device.type)  # Note [Recompute under the forward's autocast]
        ctx.save_for_backward(x)
        out = tiling.output(x)
        for k, tile in enumerate(tiling.tiles):
            y = tiling.run(tiling.tile_input(x, tile), tile)
            out[tile.dst].copy_(y)
            del y
            if tiling.progress is not None:
                tiling.progress(f"forward tile {k + 1}/{len(tiling.tiles)}")
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        tiling: Tiling = ctx.tiling
        (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[1]
        params = tiling.params
        grad_x = torch.zeros_like(x) if need_x else None
        acc: list[Optional[torch.Tensor]] = [None] * len(params)
        for k, tile in enumerate(tiling.tiles):
            # Note [Recompute is not swapped]
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_identity, _identity), \
                    _recompute_autocast(x.device.type, ctx.autocast):
                xt = x[tile.src].detach()
                moved = tiling.moves(x)
                if moved:
                    xt = tiling.staging.to_device(xt)
                if need_x:
                    xt.requires_grad_(True)
                xin = xt.clone() if tiling.copy_input else xt  # a leaf that needs grad: never written in place
                y = tiling.run(xin, tile)
                g = grad_out[tile.dst]
                wrt = ([xt] if need_x else []) + params
                grads = torch.autograd.grad(y, wrt, g, allow_unused=True) if y.requires_grad else (None,) * len(wrt)
            del y, xin
            if need_x:
                if grads[0] is not None and moved:
                    tiling.staging.add_to_host(grads[0], grad_x[tile.src])  # added in tile order, by the flush
                elif grads[0] is not None:
                    grad_x[tile.src] += grads[0]
                grads = grads[1:]
            for i, g_ in enumerate(grads):
                if g_ is not None:
                    acc[i] = g_ if acc[i] is None else acc[i].add_(g_)
            del grads, xt
            if tiling.progress is not None:
                tiling.progress(f"backward tile {k + 1}/{len(tiling.tiles)}")
        if tiling.moves(x):
            tiling.staging.flush()
        return (None, grad_x, *acc)
