"""A chain of FT-compatible operators run tile by tile along its spatial dimensions (an FT segment).

Each tile's slices come from ``swap.tiling.plan.geometry.spans`` (the same arithmetic the planner
prices); each windowed operator runs with padding 0 on its input slice padded by exactly what that tile
lacks of the operator's own padding (Note [Exact borders] in swap/tiling/plan/geometry.py).

Note [One buffer per tile shape]
SFT (segmented fused-tiled execution) needed a hand-written cache sharing one buffer per tile shape, because its
checkpoint manager allocated anew per tile until memory ran out. Here a tile reads a view of the boundary (no copy),
border tiles pad up to the interior tiles' extents (so a dimension has at most two tile shapes: ``geometry.grid``), the
output is written into one preallocated tensor and input gradients are added into another, and every
tensor of a tile is dropped before the next tile starts. Each tile then asks the allocator for the same
sizes in the same order as the tile before, which a caching allocator serves from the blocks that tile
freed (vmalloc: any free chunk serves any request): reserved memory stays flat over tiles and iterations
(tests/swap/tiling/test_tiled_allocator.py measures it on vmalloc's host backend, test_tiled_spatial.py with
LiveBytesMeter).
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..plan.geometry import Span, Window, grid, spans
from .function import Tile, Tiling
from .staging import Staging

CONV_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
MAX_FN = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
AVG_FN = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def window_call(layer: nn.Module, dims: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``layer`` with padding 0, for a tile that carries its own padding."""
    if isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        fn = CONV_FN[dims]
        return lambda x: fn(x, layer.weight, layer.bias, layer.stride, 0, layer.dilation, layer.groups)
    if isinstance(layer, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)):
        fn = MAX_FN[dims]
        stride = layer.stride or layer.kernel_size
        return lambda x: fn(x, layer.kernel_size, stride, 0, layer.dilation, False)
    if isinstance(layer, (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)):
        fn = AVG_FN[dims]
        stride = layer.stride or layer.kernel_size
        if dims == 1:
            return lambda x: fn(x, layer.kernel_size, stride, 0, False, True)
        return lambda x: fn(x, layer.kernel_size, stride, 0, False, True, layer.divisor_override)
    raise TypeError(f"no tiled form of {type(layer).__name__}")


class Step:
    """One operator of a segment: ``call(x)`` on a tile; windows and pad value from its rule."""

    def __init__(self, name: str, call: Callable[[torch.Tensor], torch.Tensor], windows: tuple[Window, ...],
                 pad_value: float, params: list[torch.Tensor]) -> None:  # fmt: skip
        self.name, self.call, self.windows, self.pad_value, self.params = name, call, windows, pad_value, params


def _pads(per_dim: list[Span]) -> list[int]:
    """F.pad's argument: last dimension first, (before, after) each."""
    out: list[int] = []
    for s in reversed(per_dim):
        out += [s.pad_a, s.pad_b]
    return out


class TiledSegment(nn.Module):
    """Runs ``steps`` on an input of ``in_shape`` (N, C, spatial...) in ``tiles`` tiles per spatial dimension
    of the output (``out_shape``); ``sizes[d]`` are the chain's extents along spatial dimension d (its input,
    then each step's output).

    The layers are not registered as submodules (they belong to the user's model, which owns their
    parameters); the segment holds them to call them."""

    def __init__(self, steps: list[Step], tiles: tuple[int, ...], in_shape: tuple[int, ...],
                 out_shape: tuple[int, ...], sizes: list[list[int]], out_dtype: torch.dtype, copy_input: bool = False,
                 progress: Optional[Callable[[str], None]] = None,
                 device: Optional[torch.device] = None) -> None:  # fmt: skip
        super().__init__()
        self.device = device  # tiles compute here when the input is elsewhere (Note [Host inputs])
        self.staging = Staging(device) if device is not None else None  # reused every call (Note [Staged host tiles])
        self.steps, self.tiles, self.copy_input, self.progress = steps, tuple(tiles), copy_input, progress
        self.in_shape, self.out_shape, self.out_dtype = tuple(in_shape), tuple(out_shape), out_dtype
        self.tile_list = self._plan(sizes)

    def extra_repr(self) -> str:
        return f"{' -> '.join(s.name for s in self.steps)}, tiles={'x'.join(map(str, self.tiles))}"

    def _plan(self, sizes: list[list[int]]) -> list[Tile]:
        per_dim: list[list[list[Span]]] = []
        for d in range(len(self.tiles)):
            windows = [s.windows[d] for s in self.steps]
            per_dim.append([spans(windows, sizes[d], lo, hi) for lo, hi in grid(self.out_shape[2 + d], self.tiles[d])])
        tiles = []
        for combo in itertools.product(*per_dim):
            src = (slice(None), slice(None), *(slice(c[0].a, c[0].b) for c in combo))
            dst = (slice(None), slice(None), *(slice(c[-1].lo, c[-1].hi) for c in combo))
            pads = [_pads([c[k] for c in combo]) for k in range(len(self.steps))]
            tiles.append(Tile(src, dst, pads))
        return tiles

    def run(self, x: torch.Tensor, tile: Tile) -> torch.Tensor:
        for step, pads in zip(self.steps, tile.arg):
            if any(pads):
                x = F.pad(x, pads, value=step.pad_value)
            x = step.call(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape) != self.in_shape:
            raise ValueError(f"this tiled segment was planned for inputs of shape {self.in_shape}, "
                             f"not {tuple(x.shape)}")
        shape, dtype, device = self.out_shape, self.out_dtype, self.device

        def output(inp: torch.Tensor) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=device or inp.device)

        params = [p for s in self.steps for p in s.params]
        return Tiling(self.run, self.tile_list, output, params, self.copy_input, self.progress, device,
                      self.staging).apply(x)  # fmt: skip
