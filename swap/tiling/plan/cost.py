"""Peak bytes and step time of a training step with some chains of an ``OpGraph`` run as tiled segments.

Note [What a tiled segment holds]
A segment [start, end] becomes one node of the step: in forward it saves its input (the boundary) and
writes its output into a preallocated tensor, running one tile at a time without gradients, so the only
extra bytes are one tile's operands (``forward_tile_bytes``). In backward it holds its input, the gradient
of its output, the gradient of its input (when that needs one), and one tile recomputed with gradients
through the segment and its backward (``backward_tile_bytes``: the eager model of Note [The eager memory
model] run on the tile's chain, its padded copies included). Tiles of one shape cost the same, so each
distinct shape is priced once and counted (at most 2 shapes per dimension: ``geometry.grid``).

Note [Host inputs]
With ``swapped=True`` a model input that only tiled segments read (the image itself, the largest tensor of a
gigapixel step) stays in host memory: the segment copies each tile's slice to the device (the runtime's
``TiledSegment(device=...)``), so the input costs the device nothing but that copy, which the tile's bytes
count (it is not a view of a device tensor any more). Its gradient, when it has one, is summed on the host.

Step time is priced on the device roofline (``DeviceProfile.step_seconds``) per operator: an untiled
operator once forward and once backward; a tiled one per tile at the tile's extent (its halo included),
twice forward (the forward pass, the backward's recompute) and once backward. With swapped boundaries, the
saved tensors go to the host during forward and come back during backward, overlapped with compute:
each phase takes the longer of its compute and its copies (a lower bound the swap runtime approaches when
its window hides the copies).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field, replace

from .geometry import grid, spans
from .graph import OpGraph, OpNode
from .memory import Peak, step_peak


@dataclass(frozen=True)
class Segment:
    """Nodes ``start..end`` (a chain from ``OpGraph.runs``) run tile by tile, ``tiles[d]`` tiles along
    spatial dimension d of the segment's output (all 1: the segment is a plain checkpoint)."""

    start: int
    end: int
    tiles: tuple[int, ...]

    @property
    def count(self) -> int:
        return math.prod(self.tiles)


@dataclass
class TileShape:
    """One distinct tile of a segment: how many tiles have it, the shape of its slice of the segment's input
    (real positions only: a border tile's padding is added by a copy, Note [Exact borders]), and per operator
    the padded input extents, the output extents and whether it pads."""

    count: int
    ops: list[tuple[tuple[int, ...], tuple[int, ...], bool]]
    input: tuple[int, ...]


def tile_shapes(graph: OpGraph, seg: Segment) -> list[TileShape]:
    """The segment's tiles, grouped by shape."""
    ops = graph.nodes[seg.start : seg.end + 1]
    dims = len(ops[0].windows)
    per_dim: list[Counter] = []
    for d in range(dims):
        windows = [op.windows[d] for op in ops]
        sizes = [ops[0].in_shape[2 + d]] + [op.out_shape[2 + d] for op in ops]
        sig: Counter = Counter()
        for lo, hi in grid(sizes[-1], seg.tiles[d]):
            chain = spans(windows, sizes, lo, hi)
            per_op = tuple((s.padded_extent, s.hi - s.lo, bool(s.pad_a or s.pad_b)) for s in chain)
            sig[(chain[0].b - chain[0].a, per_op)] += 1
        per_dim.append(sig)
    out: list[TileShape] = []
    for combo in itertools.product(*(c.items() for c in per_dim)):
        count = math.prod(n for _, n in combo)
        shaped = []
        for k, op in enumerate(ops):
            padded = tuple(c[0][1][k][0] for c in combo)
            extent = tuple(c[0][1][k][1] for c in combo)
            pads = any(c[0][1][k][2] for c in combo)
            shaped.append(((*op.in_shape[:2], *padded), (*op.out_shape[:2], *extent), pads))
        real_input = (*ops[0].in_shape[:2], *(c[0][0] for c in combo))
        out.append(TileShape(count, shaped, real_input))
    return out


def tile_chain(graph: OpGraph, seg: Segment, shape: TileShape, input_grad: bool) -> list[OpNode]:
    """The tile's operators as a chain of ``OpNode`` at the tile's extents, with a node for each padded
    copy the runtime makes (Note [Exact borders] in geometry), for the eager memory model."""
    ops = graph.nodes[seg.start : seg.end + 1]
    chain = [OpNode("tile input", "input", out_shape=shape.input, itemsize=ops[0].in_itemsize, needs_grad=input_grad)]
    for op, (padded, extent, pads) in zip(ops, shape.ops):
        if pads:
            prev = chain[-1]
            chain.append(OpNode(f"pad {op.name}", "pointwise", inputs=(len(chain) - 1,), in_shape=prev.out_shape,
                                out_shape=padded, itemsize=op.in_itemsize, in_itemsize=op.in_itemsize,
                                needs_grad=prev.needs_grad))  # fmt: skip
        node = op.at(padded, extent)
        chain.append(replace(node, inputs=(len(chain) - 1,), needs_grad=chain[-1].needs_grad or op.params > 0))
    return chain


def forward_tile_bytes(chain: list[OpNode]) -> int:
    """One tile's bytes in the no-grad forward: each operator's input and output, nothing saved."""
    return max(chain[k].in_bytes + chain[k].out_bytes for k in range(1, len(chain)))


def backward_tile_bytes(chain: list[OpNode], copied: bool = False) -> int:
    """One tile recomputed with gradients and run backward (the input slice is a view, not counted, unless
    ``copied`` from the host: Note [Host inputs])."""
    peak = step_peak(chain, (len(chain) - 1,))
    return peak.bytes - (0 if copied else chain[0].out_bytes)


def host_inputs(graph: OpGraph, segments: list[Segment]) -> set[int]:
    """The model inputs that only the given segments read (Note [Host inputs])."""
    starts = {s.start for s in segments}
    return {i for i, n in enumerate(graph.nodes)
            if n.kind == "input" and graph.users[i] and all(u in starts for u in graph.users[i])}  # fmt: skip


@dataclass
class Estimate:
    """A step's predicted peak (bytes, where) and time (seconds) on a device, with what it is made of."""

    peak: Peak
    seconds: float
    forward_seconds: float
    backward_seconds: float
    segments: list[Segment]
    nodes: list[OpNode] = field(default_factory=list)  # the step's nodes, a segment as one
    copy_bytes: int = 0  # host copies per direction (swapped boundaries)
    tiles: dict[int, int] = field(default_factory=dict)  # node of the step -> tiles

    @property
    def bytes(self) -> int:
        return self.peak.bytes

    def where(self) -> OpNode:
        return self.nodes[self.peak.node]


def _times(node: OpNode, dev, lowp: bool) -> tuple[float, float]:  # noqa: ANN001 - a DeviceProfile
    moved = node.in_bytes + node.out_bytes + node.params
    fwd = dev.step_seconds(node.flops, moved, lowp)
    bwd = dev.step_seconds(node.flops_bwd, 2 * moved, lowp) if node.needs_grad else 0.0
    return fwd, bwd


def estimate(graph: OpGraph, segments: list[Segment], dev=None, lowp: bool = False, swapped: bool = False,  # noqa: ANN001
             extra: int = 0) -> Estimate:  # fmt: skip
    """The step's peak and time with ``segments`` tiled (Note [What a tiled segment holds]).

    ``dev`` is a ``swap.devices.DeviceProfile`` (None: no time); ``extra`` bytes are live throughout
    (optimizer state, the loss's tensors); ``swapped`` puts saved tensors on the host between uses."""
    by_start = {s.start: s for s in segments}
    host = host_inputs(graph, segments) if swapped else set()  # Note [Host inputs]
    host_copy = 0  # bytes of tile slices copied from host inputs, per pass
    nodes: list[OpNode] = []
    remap: dict[int, int] = {}
    tf: dict[int, int] = {}
    tb: dict[int, int] = {}
    tiles: dict[int, int] = {}
    fwd_s = bwd_s = 0.0
    i = 0
    while i < len(graph.nodes):
        node = graph.nodes[i]
        seg = by_start.get(i)
        if seg is None:
            if i in host:
                node = replace(node, itemsize=0)  # on the host: no device bytes
            nodes.append(replace(node, inputs=tuple(remap[j] for j in node.inputs)))
            remap[i] = len(nodes) - 1
            if dev is not None and node.kind != "input":
                f, b = _times(node, dev, lowp)
                fwd_s, bwd_s = fwd_s + f, bwd_s + b
            i += 1
            continue
        ops = graph.nodes[seg.start : seg.end + 1]
        last = ops[-1]
        input_grad = graph.nodes[node.inputs[0]].needs_grad
        params = sum(op.params for op in ops)
        k = len(nodes)
        nodes.append(OpNode(
            f"{node.name}..{last.name}", "segment", f"{node.where}..{last.where}", inputs=(remap[node.inputs[0]],),
            in_shape=node.in_shape, out_shape=last.out_shape, itemsize=last.itemsize, in_itemsize=node.in_itemsize,
            save_in=node.in_bytes if last.needs_grad and node.inputs[0] not in host else 0, params=params,
            needs_grad=last.needs_grad,
            flops=sum(op.flops for op in ops), flops_bwd=sum(op.flops_bwd for op in ops),
        ))  # fmt: skip
        shapes = tile_shapes(graph, seg)
        tf[k] = max(forward_tile_bytes(c) for c in (tile_chain(graph, seg, s, False) for s in shapes))
        chains = [(s, tile_chain(graph, seg, s, input_grad)) for s in shapes]
        tb[k] = max(backward_tile_bytes(c, node.inputs[0] in host) for _, c in chains) if last.needs_grad else 0
        tiles[k] = seg.count
        if node.inputs[0] in host:  # each tile's input slice crosses the link in forward and in the recompute
            host_copy += sum(s.count * c[0].out_bytes for s, c in chains)
        if dev is not None:
            for s, c in chains:
                for op in c[1:]:
                    f, b = _times(op, dev, lowp)
                    fwd_s += s.count * f
                    bwd_s += s.count * (f + b)
        for j in range(seg.start, seg.end + 1):
            remap[j] = k
        i = seg.end + 1
    outputs = tuple(sorted({remap[j] for j in graph.outputs}))
    peak = step_peak(nodes, outputs, base=graph.params + extra, transient_fwd=tf, transient_bwd=tb, swapped=swapped)
    copy = 0
    if swapped:
        copy = sum(n.save_in + n.save_out + n.save_extra for n in nodes)
    seconds = 0.0
    if dev is not None:
        if swapped:  # saved tensors go out in forward and come back in backward; host inputs' tiles come in both
            fwd_s = max(fwd_s, copy / dev.d2h_bandwidth, host_copy / dev.h2d_bandwidth)
            bwd_s = max(bwd_s, (copy + host_copy) / dev.h2d_bandwidth)
        seconds = fwd_s + bwd_s
    return Estimate(peak, seconds, fwd_s, bwd_s, list(segments), nodes, copy, tiles)

