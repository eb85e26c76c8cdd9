"""The operator graph of one forward pass, as the tiling planner sees it: pure data (``OpGraph``).

``swap.tiling.plan.analyze`` builds it from a model and an input shape on the meta device; the planner
(``choose``), the memory and time model (``cost``) and the tests work on it without torch state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

from .geometry import Window


@dataclass(frozen=True)
class OpNode:
    """One operator of the forward pass.

    Attributes:
        name: the graph's name for it (fx node name); ``where`` names it for people (module path, function).
        kind: "input" (a model input), "window", "pointwise" (Note [FT-compatible operators]), "barrier"
            (runs untiled; ``reason`` says why) or "output".
        windows: per spatial dimension, how an output slice reads the input (window and pointwise kinds).
        inputs: indices of the nodes whose outputs it reads (activations only; parameters are ``params``).
        in_shape, out_shape: of its first activation input and of its output.
        itemsize: bytes per element of its output.
        alias: its output shares its input's memory (an in-place operator or a view).
        save_in, save_out, save_extra: bytes autograd saves of its input, of its output, and of new tensors
            shaped like its output (max pooling's indices), when it runs with gradients.
        params: bytes of the parameters it reads that need gradients.
        flops, flops_bwd: forward and backward FLOPs at ``out_shape``.
        needs_grad: its output requires a gradient (it depends on a parameter).
    """

    name: str
    kind: str
    where: str = ""
    windows: tuple[Window, ...] = ()
    reason: str = ""
    inputs: tuple[int, ...] = ()
    in_shape: tuple[int, ...] = ()
    out_shape: tuple[int, ...] = ()
    itemsize: int = 4
    in_itemsize: int = 4
    alias: bool = False
    save_in: int = 0
    save_out: int = 0
    save_extra: int = 0
    params: int = 0
    flops: float = 0.0
    flops_bwd: float = 0.0
    needs_grad: bool = True

    @property
    def out_bytes(self) -> int:
        return math.prod(self.out_shape) * self.itemsize

    @property
    def in_bytes(self) -> int:
        return math.prod(self.in_shape) * self.in_itemsize

    @property
    def tileable(self) -> bool:
        return self.kind in ("window", "pointwise")

    @property
    def strided(self) -> bool:
        """A window with a stride (a pooling, a strided convolution): the chain shrinks after it, so a segment
        split there leaves a shallower segment with a smaller halo."""
        return self.kind == "window" and any(w.sigma > 1 for w in self.windows)

    def at(self, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> OpNode:
        """The same operator on a slice: saved bytes and FLOPs scale with the slice's elements."""
        fi = math.prod(in_shape) / max(1, math.prod(self.in_shape))
        fo = math.prod(out_shape) / max(1, math.prod(self.out_shape))
        return replace(self, in_shape=in_shape, out_shape=out_shape, save_in=round(self.save_in * fi),
                       save_out=round(self.save_out * fo), save_extra=round(self.save_extra * fo),
                       flops=self.flops * fo, flops_bwd=self.flops_bwd * fo)  # fmt: skip


@dataclass
class OpGraph:
    """The forward pass in execution order (``nodes[i].inputs`` index earlier nodes)."""

    nodes: list[OpNode]
    params: int = 0  # bytes of all parameters and buffers
    grads: int = 0  # bytes of the parameters that get gradients
    outputs: tuple[int, ...] = ()  # the nodes whose values the model returns
    users: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.users = [[] for _ in self.nodes]
        for i, n in enumerate(self.nodes):
            for j in n.inputs:
                self.users[j].append(i)

    def runs(self) -> list[tuple[int, int]]:
        """Maximal chains [start, end] of tileable nodes: each node's only activation input is the previous
        node, whose only user it is, with the same number of spatial dimensions (at least one)."""
        out: list[tuple[int, int]] = []
        start: Optional[int] = None
        for i, n in enumerate(self.nodes):
            chained = (
                start is not None
                and n.tileable
                and n.inputs == (i - 1,)
                and self.users[i - 1] == [i]
                and i - 1 not in self.outputs
                and len(n.windows) == len(self.nodes[i - 1].windows)
            )
            if chained:
                continue
            if start is not None:
                out.append((start, i - 1))
            start = i if n.tileable and len(n.inputs) == 1 and len(n.windows) >= 1 else None
        if start is not None:
            out.append((start, len(self.nodes) - 1))
        return out
