"""Segments and tile counts from the budget: the planner of tiled execution (pure, over an ``OpGraph``).

Note [Choosing segments and tiles]
SFT (segmented fused-tiled execution, CC'22) brute-forces the tile count over runs. Here the count comes from the
memory model (``cost.estimate``), without running anything:

1. Nothing is tiled when the untiled step fits the budget.
2. Every maximal chain of FT-compatible operators (``OpGraph.runs``) becomes one segment with one tile (a
   checkpoint). While the predicted peak is over the budget and lies in a segment's forward or backward,
   that segment's tiles grow (tiles per dimension in proportion to the segment output's extents; the
   smallest count that moves the peak off it or under the budget, by bisection). A segment already at one
   output element per tile is split in two at the strided window nearest its middle (its tiles' halo, the
   receptive field of one output, shrinks with its depth). A peak elsewhere (an untiled operator, or an
   unsplittable segment at one element per tile) is an error that names the operator and what its step
   holds (``TilingInfeasible``).
3. With a device profile, the plan is then made faster where the budget allows: a segment is split where
   its chain shrinks (after a strided window: the halo grows with depth, and a shallower segment recomputes
   less), and a segment that the budget does not need is dropped; each change is kept when the predicted
   step time falls and the peak stays within the budget.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

from ...units import fmt_bytes as fmt
from .cost import Estimate, Segment, estimate
from .graph import OpGraph

MAX_ROUNDS = 64


class TilingInfeasible(ValueError):
    """No segments and tile counts fit the budget. ``op`` names the operator (its module path or function)
    whose step is the peak, ``working_set`` is that step's bytes (what must be live at once), ``budget``
    the budget, ``tiles`` the tiles its segment had reached (None: an untiled operator)."""

    def __init__(self, message: str, op: str, working_set: int, budget: int, tiles: Optional[int] = None) -> None:
        super().__init__(message)
        self.op, self.working_set, self.budget, self.tiles = op, working_set, budget, tiles

    @property
    def min_budget(self) -> int:
        """The smallest budget a plan fits: the peak step is tiled as far as it goes (or cannot be tiled), and
        what it holds does not depend on the other segments' tiles."""
        return self.working_set


@dataclass
class TilePlan:
    """What to tile: ``segments`` (node ranges of the graph and their tiles), the predicted step with them
    (``estimate``: peak bytes, where, seconds) and without (``untiled``)."""

    segments: list[Segment]
    estimate: Estimate
    untiled: Estimate
    budget: Optional[int]

    @property
    def peak(self) -> int:
        return self.estimate.bytes

    @property
    def seconds(self) -> float:
        return self.estimate.seconds

    def describe(self, graph: OpGraph) -> str:
        if not self.segments:
            return f"nothing tiled: the step needs {fmt(self.untiled.bytes)}"
        parts = []
        for s in self.segments:
            a, b = graph.nodes[s.start], graph.nodes[s.end]
            parts.append(f"{a.where}..{b.where} in {'x'.join(map(str, s.tiles))} tiles")
        return f"{'; '.join(parts)}: peak {fmt(self.peak)} (untiled {fmt(self.untiled.bytes)})"


def _tiles(graph: OpGraph, end: int, level: int) -> tuple[int, ...]:
    """Tiles per spatial dimension of a segment ending at node ``end``: ``level`` along its output's largest
    extent, the other dimensions in proportion."""
    extents = graph.nodes[end].out_shape[2:]
    top = max(extents)
    return tuple(max(1, min(e, round(level * e / top))) for e in extents)


def _max_level(graph: OpGraph, end: int) -> int:
    return max(graph.nodes[end].out_shape[2:])


def plan_tiles(graph: OpGraph, budget: Optional[int], *, dev=None, lowp: bool = False, swapped: bool = False,  # noqa: ANN001
               extra: int = 0, tiles: Union[None, int, tuple[int, ...]] = None) -> TilePlan:  # fmt: skip
    """Segments and tile counts whose predicted peak fits ``budget`` (Note [Choosing segments and tiles]).

    Args:
        graph: the forward pass (``swap.tiling.plan.analyze``).
        budget: device bytes for the step (None: only with ``tiles``).
        dev: a ``DeviceProfile`` to price the step on (and to make the plan faster); None: memory only.
        lowp: the model computes in bf16/fp16 (the device's tensor-core peak).
        swapped: saved tensors (segment boundaries among them) go to the host between uses.
        extra: bytes live throughout that the graph does not show (optimizer state, the loss's tensors).
        tiles: tile every chain in this many tiles per spatial dimension (int or tuple) instead of choosing.
    Raises:
        TilingInfeasible: nothing fits; names the operator at the peak and its working set.
    """
    untiled = estimate(graph, [], dev, lowp, swapped, extra)
    runs = graph.runs()
    if tiles is not None:
        segs = []
        for a, b in runs:
            extents = graph.nodes[b].out_shape[2:]
            per = (tiles,) * len(extents) if isinstance(tiles, int) else tuple(tiles)
            if len(per) != len(extents):
                raise ValueError(f"tiles={tiles!r} for a chain with {len(extents)} spatial dimensions")
            segs.append(Segment(a, b, tuple(max(1, min(e, t)) for e, t in zip(extents, per))))
        return TilePlan(segs, estimate(graph, segs, dev, lowp, swapped, extra), untiled, budget)
    if budget is None:
        raise ValueError("give a budget (bytes of device memory for the step) or tiles=")
    if untiled.bytes <= budget:
        return TilePlan([], untiled, untiled, budget)
    levels = {a: 1 for a, _ in runs}
    ends = dict(runs)

    def build(lv: dict[int, int]) -> list[Segment]:
        return [Segment(a, ends[a], _tiles(graph, ends[a], level)) for a, level in sorted(lv.items())]

    est = estimate(graph, build(levels), dev, lowp, swapped, extra)
    for _ in range(MAX_ROUNDS):
        if est.bytes <= budget:
            break
        seg = _segment_at(est)
        if seg is not None and levels[seg.start] >= _max_level(graph, seg.end):
            cut = _split_point(graph, seg)
            if cut is not None:  # a shallower segment has a smaller halo: split it where the chain shrinks
                ends[seg.start], ends[cut + 1], levels[seg.start], levels[cut + 1] = cut, seg.end, 1, 1
                est = estimate(graph, build(levels), dev, lowp, swapped, extra)
                continue
        if seg is None or levels[seg.start] >= _max_level(graph, seg.end):
            raise _infeasible(graph, est, budget, seg)
        start, top = seg.start, _max_level(graph, seg.end)

        def moves(level: int, start: int = start) -> bool:
            e = estimate(graph, build({**levels, start: level}), dev, lowp, swapped, extra)
            return e.bytes <= budget or _segment_at(e) is None or _segment_at(e).start != start

        lo, hi = levels[start], levels[start] * 2
        while hi < top and not moves(hi):
            lo, hi = hi, hi * 2
        hi = min(hi, top)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if moves(mid) else (mid, hi)
        levels[start] = hi
        est = estimate(graph, build(levels), dev, lowp, swapped, extra)
    else:
        raise _infeasible(graph, est, budget, _segment_at(est))
    plan = TilePlan(est.segments, est, untiled, budget)
    if dev is not None:
        plan = _faster(graph, plan, budget, dev, lowp, swapped, extra)
    return plan


def _split_point(graph: OpGraph, seg: Segment) -> Optional[int]:
    """The strided window (a pooling, a strided convolution) nearest the middle of the segment, where it
    splits in two; None when it has none before its last operator."""
    cuts = [i for i in range(seg.start, seg.end) if graph.nodes[i].strided]
    middle = (seg.start + seg.end) / 2
    return min(cuts, key=lambda i: abs(i - middle)) if cuts else None


def _segment_at(est: Estimate) -> Optional[Segment]:
    node = est.where()
    if node.kind != "segment":
        return None
    k = sum(1 for n in est.nodes[: est.peak.node] if n.kind == "segment")
    return est.segments[k]


def _fit(graph: OpGraph, segs: list[Segment], budget: int, dev, lowp: bool, swapped: bool,  # noqa: ANN001
         extra: int) -> Optional[Estimate]:  # fmt: skip
    """``segs`` with each segment's tiles grown until the plan fits, or None."""
    segs = list(segs)
    for _ in range(MAX_ROUNDS):
        est = estimate(graph, segs, dev, lowp, swapped, extra)
        if est.bytes <= budget:
            return est
        seg = _segment_at(est)
        if seg is None:
            return None
        top = _max_level(graph, seg.end)
        if max(seg.tiles) >= top:
            return None
        segs[segs.index(seg)] = replace(seg, tiles=_tiles(graph, seg.end, min(max(seg.tiles) * 2, top)))
    return None


def _faster(graph: OpGraph, plan: TilePlan, budget: int, dev, lowp: bool, swapped: bool,  # noqa: ANN001
            extra: int) -> TilePlan:  # fmt: skip
    best = plan.estimate
    for _ in range(MAX_ROUNDS):
        candidates: list[list[Segment]] = []
        segs = best.segments
        for k, s in enumerate(segs):
            candidates.append(segs[:k] + segs[k + 1 :])  # drop it
            for cut in range(s.start, s.end):
                if graph.nodes[cut].strided:
                    left = Segment(s.start, cut, _tiles(graph, cut, 1))
                    right = Segment(cut + 1, s.end, s.tiles)
                    candidates.append(segs[:k] + [left, right] + segs[k + 1 :])
            if max(s.tiles) > 1:  # fewer tiles where the budget allows
                fewer = _tiles(graph, s.end, max(1, max(s.tiles) - 1))
                candidates.append(segs[:k] + [replace(s, tiles=fewer)] + segs[k + 1 :])
        improved = None
        for cand in candidates:
            est = _fit(graph, cand, budget, dev, lowp, swapped, extra)
            if est is not None and est.seconds < (improved or best).seconds * (1 - 1e-6):
                improved = est
        if improved is None:
            break
        best = improved
    return TilePlan(best.segments, best, plan.untiled, budget)


def _infeasible(graph: OpGraph, est: Estimate, budget: int, seg: Optional[Segment]) -> TilingInfeasible:
    node = est.where()
    phase = est.peak.phase
    if seg is not None:
        tiles = "x".join(map(str, seg.tiles))
        msg = (
            f"cannot tile {node.where} under a budget of {fmt(budget)}: at {tiles} tiles (one output element "
            f"per tile along its largest dimension) its {phase} step still needs {fmt(est.bytes)}: its input "
            f"{fmt(node.in_bytes)} and output {fmt(node.out_bytes)} (and their gradients in backward) are whole "
            "tensors. Swap the segment boundaries to the host (swapped=True with swap.SwapManager), lower the image "
            "size, or raise the budget."
        )
        return TilingInfeasible(msg, node.where, est.bytes, budget, seg.count)
    why = f" ({node.reason})" if node.reason else ""
    own = node.in_bytes + node.out_bytes + node.save_extra
    msg = (
        f"cannot fit the step under a budget of {fmt(budget)}: the {phase} of operator `{node.where}`{why} needs "
        f"{fmt(est.bytes)} with everything tiled that can be; its own input and output are {fmt(own)}, the rest is "
        "what the step holds there (parameters, saved segment boundaries, gradients). Make it tileable (Note "
        "[FT-compatible operators] in swap/tiling/plan/rules.py), swap saved tensors to the host, lower the "
        "input size, or raise the budget."
    )
    return TilingInfeasible(msg, node.where, est.bytes, budget, None)
