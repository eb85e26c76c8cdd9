"""The largest image a model trains on under a budget, per strategy, and the step time at each size.

Note [Strategies for one large image]
Each strategy is priced on the same operator graph (``analyze`` on the meta device, no memory used):

- ``untiled``: PyTorch as is (SFT's PyTorch-Base baseline): every activation saved until its backward.
- ``checkpoint``: every chain of FT-compatible operators is a checkpointed segment (one tile): only the
  boundaries are saved, each segment is recomputed whole in backward. The segments are the chains, or the
  chains cut at every strided window (a VGG block each), whichever peaks lower: SFT's
  ``checkpoint_sequential`` baseline at its best segment count, within what the graph allows.
- ``swap``: the swap runtime alone, at its floor: every saved tensor on the host between its save and its
  use (``swapped=True``, copies overlapped with compute); each operator's own inputs and outputs stay whole.
- ``tiled``: segmented fused-tiled execution (SFT, CC'22) (``plan_tiles``: segments and tile counts from the budget).
- ``tiled+swap``: the same with the saved tensors (the segment boundaries) on the host between their uses,
  as ``swap.SwapManager`` moves them: beyond SFT, whose boundaries stay on the device.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from .analyze import analyze, trace
from .choose import TilePlan, TilingInfeasible, plan_tiles
from .cost import Segment, estimate
from .graph import OpGraph

IMAGE_STRATEGIES = ("untiled", "checkpoint", "swap", "tiled", "tiled+swap")  # a set apart from swap.STRATEGIES


@dataclass
class ImagePlan:
    """One strategy at one image side: whether it fits, its predicted peak bytes and step seconds, the plan."""

    strategy: str
    side: int
    fits: bool
    peak: int
    seconds: float
    describe: str = ""


def image_graph(model: nn.Module, side: int, batch: int = 1, channels: int = 3,
                dtype: torch.dtype = torch.float32) -> OpGraph:  # fmt: skip
    """The training step's operator graph for ``batch`` images of ``side`` x ``side`` (meta device)."""
    x = torch.empty((batch, channels, side, side), dtype=dtype, device="meta")
    return analyze(trace(model), (x,)).graph


def _checkpoint_segments(graph: OpGraph) -> list[list[Segment]]:
    whole = [Segment(a, b, (1,) * len(graph.nodes[b].windows)) for a, b in graph.runs()]
    cut: list[Segment] = []
    for a, b in graph.runs():
        start = a
        for i in range(a, b + 1):
            node = graph.nodes[i]
            if i == b or node.strided:
                cut.append(Segment(start, i, (1,) * len(node.windows)))
                start = i + 1
    return [whole, cut]


def plan_image(graph: OpGraph, side: int, strategy: str, budget: int, dev, lowp: bool = False,  # noqa: ANN001
               extra: int = 0) -> ImagePlan:  # fmt: skip
    """``strategy`` (Note [Strategies for one large image]) on ``graph`` under ``budget`` bytes."""
    if strategy not in IMAGE_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose among {', '.join(IMAGE_STRATEGIES)}")
    if strategy in ("untiled", "swap"):
        e = estimate(graph, [], dev, lowp, swapped=strategy == "swap", extra=extra)
        return ImagePlan(strategy, side, e.bytes <= budget, e.bytes, e.seconds)
    if strategy == "checkpoint":
        e = min((estimate(graph, segs, dev, lowp, extra=extra) for segs in _checkpoint_segments(graph)),
                key=lambda e: (e.bytes > budget, e.seconds if e.bytes <= budget else e.bytes))  # fmt: skip
        return ImagePlan(strategy, side, e.bytes <= budget, e.bytes, e.seconds, f"{len(e.segments)} segments")
    try:
        p: TilePlan = plan_tiles(graph, budget, dev=dev, lowp=lowp, extra=extra)
    except TilingInfeasible as err:
        if strategy == "tiled":
            return ImagePlan(strategy, side, False, err.working_set, float("nan"), str(err).split(":")[0])
        try:  # swap only where tiling alone does not fit
            p = plan_tiles(graph, budget, dev=dev, lowp=lowp, swapped=True, extra=extra)
        except TilingInfeasible as err2:
            return ImagePlan(strategy, side, False, err2.working_set, float("nan"), str(err2).split(":")[0])
    return ImagePlan(strategy, side, True, p.peak, p.seconds, p.describe(graph))


def largest_image(model: nn.Module, budget: int, dev, strategy: str, *, step: int = 32, batch: int = 1,  # noqa: ANN001
                  channels: int = 3, dtype: torch.dtype = torch.float32, extra: int = 0, limit: int = 1 << 20,
                  progress: Optional[Callable[[str], None]] = None) -> Optional[ImagePlan]:  # fmt: skip
    """The largest square image side (a multiple of ``step``) that ``strategy`` trains on within ``budget``
    (doubling, then bisection); None when not even ``step`` fits."""
    lowp = dtype in (torch.bfloat16, torch.float16)
    plans: dict[int, ImagePlan] = {}

    def fits(side: int) -> bool:
        p = plan_image(image_graph(model, side, batch, channels, dtype), side, strategy, budget, dev, lowp, extra)
        if progress is not None:
            progress(f"{strategy} at {side}x{side}: {'fits' if p.fits else 'does not fit'}")
        plans[side] = p
        return p.fits

    side = largest_side(fits, step, start=step, limit=limit)
    return plans[side] if side else None


def largest_side(fits: Callable[[int], bool], step: int, start: int, limit: Optional[int] = None) -> int:
    """The largest multiple of ``step`` from ``start`` on for which ``fits`` holds, assuming that what fits at
    a side fits at every smaller one: doubling from ``start`` (while the side is at most ``limit``), then
    bisection between the last side that fits and the first that does not; 0 if not even ``start`` fits."""
    if not fits(start):
        return 0
    lo, hi = start, 2 * start
    while (limit is None or hi <= limit) and fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def stderr_progress(msg: str) -> None:
    print(f"  [swap.plan tiling] {msg}", file=sys.stderr, flush=True)


def largest_images(model: nn.Module, budget: int, dev, strategies: tuple[str, ...] = IMAGE_STRATEGIES,  # noqa: ANN001
                   progress: Optional[Callable[[str], None]] = None, **kw) -> dict[str, Optional[ImagePlan]]:  # noqa: ANN003
    """``largest_image`` per strategy."""
    return {s: largest_image(model, budget, dev, s, progress=progress, **kw) for s in strategies}


def image_table(found: dict[str, Optional[ImagePlan]], budget: int, device: str) -> str:
    """The CLI's answer: per strategy, the largest image, its predicted peak and step time, and the plan."""
    from ...units import fmt_bytes

    lines = [f"largest square image per strategy, budget {fmt_bytes(budget)} on {device}:",
             f"{'strategy':<12} {'largest image':>14} {'peak':>11} {'step':>10}  plan"]  # fmt: skip
    for name, p in found.items():
        if p is None:
            lines.append(f"{name:<12} {'none fits':>14}")
            continue
        size = f"{p.side}x{p.side}"
        lines.append(f"{name:<12} {size:>14} {fmt_bytes(p.peak):>11} {p.seconds:>9.2f}s  {p.describe}")
    return "\n".join(lines)
