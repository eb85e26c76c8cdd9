"""Which slice of an operator's input a slice of its output needs: the σ·T + δ rule of fused tiling (an
output slice of extent T needs an input slice of σ·T + δ), and tile grids.

Pure integer arithmetic on extents along one spatial dimension; the runtime (swap.tiling.run) and the
planner (swap.tiling.plan.choose) both use it, so what is planned is what runs.

Note [Exact borders]
A windowed operator (convolution, pooling) with padding p reads p positions before the first input
position and after the last. A tile reads real neighbours where it has them and the operator's padding value
only where the full tensor would: ``need`` returns the input range clipped to the tensor and, separately, how
many padding positions the tile must add on each side (zero for interior tiles). The runtime runs the
operator with padding 0 on the tile padded by exactly those amounts (zeros for a convolution, -inf for max
pooling), so every output element is computed from exactly the values the untiled operator uses, and a
border tile's padded input has the same extent as an interior tile's (Note [One buffer per tile shape] in
swap/tiling/run/segment.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    """How one spatial dimension of an operator's output reads its input: output position o reads input
    positions ``o*stride - pad_lo + j*dilation`` for j in [0, kernel). A pointwise operator is
    ``Window()`` (kernel 1, stride 1, no padding): σ = stride, δ = dilation·(kernel - 1). Padding after the
    last position is not a field: where the last window reaches past the input, ``need`` pads (ceil_mode
    pooling reaches further than its padding; floor mode may not reach it all)."""

    kernel: int = 1
    stride: int = 1
    pad_lo: int = 0  # the operator's padding before the first position (after the last: implied by sizes)
    dilation: int = 1
    pool: bool = False  # PyTorch's pooling takes at most kernel // 2 padding

    @property
    def sigma(self) -> int:
        return self.stride

    @property
    def delta(self) -> int:
        return self.dilation * (self.kernel - 1)

    @property
    def pointwise(self) -> bool:
        return self.kernel == 1 and self.stride == 1 and self.pad_lo == 0

    def need(self, lo: int, hi: int, n_in: int) -> tuple[int, int, int, int]:
        """Output positions [lo, hi) need input [a, b) of the n_in real positions, padded by (pad_a, pad_b)
        positions of the padding value (Note [Exact borders]). Extent: σ·(hi - lo - 1) + δ + 1."""
        if hi <= lo:
            raise ValueError(f"empty output range [{lo}, {hi})")
        a = lo * self.stride - self.pad_lo
        b = (hi - 1) * self.stride - self.pad_lo + self.delta + 1
        return max(a, 0), min(b, n_in), max(0, -a), max(0, b - n_in)


@dataclass(frozen=True)
class Span:
    """One operator's slice in one tile along one dimension: it reads input [a, b) padded by (pad_a, pad_b),
    and produces output [lo, hi)."""

    a: int
    b: int
    pad_a: int
    pad_b: int
    lo: int
    hi: int

    @property
    def padded_extent(self) -> int:
        return self.b - self.a + self.pad_a + self.pad_b


def spans(windows: list[Window], sizes: list[int], lo: int, hi: int) -> list[Span]:
    """The slices of a chain of operators (``windows[i]`` reads a tensor of ``sizes[i]`` positions and writes
    one of ``sizes[i + 1]``) that produce output [lo, hi) of the last one, first operator first: each
    operator's output slice is the next one's (clipped) input slice."""
    if len(sizes) != len(windows) + 1:
        raise ValueError("sizes must have one entry more than windows (the chain's input and each output)")
    out: list[Span] = []
    for i in range(len(windows) - 1, -1, -1):
        a, b, pa, pb = windows[i].need(lo, hi, sizes[i])
        out.append(Span(a, b, pa, pb, lo, hi))
        lo, hi = a, b
    return out[::-1]


def grid(n: int, tiles: int) -> list[tuple[int, int]]:
    """``n`` positions cut into ``tiles`` ranges of ceil(n / tiles) positions, the last one shorter when it
    does not divide (at most two tile shapes per dimension); fewer ranges when ``tiles`` does not fit."""
    if n < 1 or tiles < 1:
        raise ValueError(f"cannot cut {n} positions into {tiles} tiles")
    size = -(-n // min(tiles, n))
    return [(lo, min(n, lo + size)) for lo in range(0, n, size)]


def receptive_extent(windows: list[Window], out_extent: int) -> int:
    """Input positions (padding included) that ``out_extent`` consecutive outputs of the chain read."""
    e = out_extent
    for w in reversed(windows):
        e = w.sigma * (e - 1) + w.delta + 1
    return e


def halo(windows: list[Window]) -> int:
    """Input positions a tile reads beyond its σ-scaled share: T outputs of the chain read Π σ·(T - 1) +
    ``receptive_extent(windows, 1)`` inputs, so neighbouring tiles overlap by this many minus Π σ."""
    scale = 1
    for w in windows:
        scale *= w.sigma
    return receptive_extent(windows, 1) - scale
