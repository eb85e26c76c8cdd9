"""``swap.tiled``: the one call that tiles a model, spatially (a CNN's FT segments) or along tokens (a causal
LM's head and loss)."""

from __future__ import annotations

from typing import Optional, Union

from torch import nn

from ...devices import DeviceProfile, profile
from ...units import Size, parse_size
from .head import TiledCausalLM, is_causal_lm
from .model import TiledModel
from .progress import Progress


def tiled(model: nn.Module, budget: Size = None, *, tiles: Union[None, int, tuple[int, ...]] = None,
          device: Union[None, str, DeviceProfile] = None, swapped: bool = False, extra: Size = 0,
          progress: Progress = False) -> Union[TiledModel, TiledCausalLM]:  # fmt: skip
    """``model`` run tile by tile where that keeps a training step within ``budget`` (segmented fused tiling).

    - A model whose forward has chains of FT-compatible operators (convolutions, pooling, pointwise ops;
      Note [FT-compatible operators] in swap/tiling/plan/rules.py) gets those chains run as segments,
      tile by tile along the spatial dimensions: only segment boundaries are kept whole, each tile is
      recomputed in backward. Segments and tile counts are planned per input shape from ``budget`` (bytes of
      the whole step: parameters, gradients, activations), or fixed with ``tiles`` (per spatial dimension).
    - A Hugging Face causal LM (a linear head on a base model) gets its head and cross-entropy run along
      tokens when called with ``labels``; ``budget`` is then the bytes the head and loss may use, or
      ``tiles`` the tokens per tile (Note [Tiled head and loss] in swap/tiling/plan/head.py).

    Args:
        device: a device profile (or its name, e.g. "a100-40gb") to price plans on: with one, the planner
            also picks the fastest segments that fit; without, the fewest tiles that fit.
        swapped: plan as if saved tensors (the segment boundaries) go to host memory between their uses, as
            ``swap.SwapManager`` around the step moves them; and keep a model input that only tiled segments read
            (the image) on the host: pass it in host memory (pinned, ideally), each tile's slice is copied to the
            model's device (Note [Host inputs] in swap/tiling/plan/cost.py).
        extra: bytes the step holds that neither the model nor its optimizer shows (the caller's own tensors);
            the optimizer's state and the gradients kept from before a call are counted already (Note [What
            the step holds besides the graph] in swap/tiling/run/held.py).
        progress: log the plan and the tiles to stderr (True), or call this with each line.
    Raises:
        TilingInfeasible / HeadInfeasible (ValueError): nothing fits; names the operator and its working set.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"swap.tiled takes an nn.Module, not {type(model).__name__}")
    limit: Optional[int] = parse_size(budget, "budget", minimum=1, none="tiles= fixes the tiling instead")
    if limit is None and tiles is None:
        raise ValueError("swap.tiled needs budget= (bytes for the training step) or tiles= (tiles per dimension)")
    if is_causal_lm(model):
        if tiles is not None and not isinstance(tiles, int):
            raise TypeError(f"tiles= of a causal LM is tokens per tile (an int), not {tiles!r}")
        return TiledCausalLM(model, limit, tiles, progress)
    dev = profile(device) if isinstance(device, str) else device
    return TiledModel(model, limit, tiles=tiles, device=dev, extra=parse_size(extra, "extra") or 0, swapped=swapped,
                      progress=progress)  # fmt: skip
