"""Fused tiling's σ·T + δ rule (an output slice of extent T needs σ·T + δ of the input) and the tile grid (pure
integer arithmetic, swap.tiling.plan.geometry)."""

from __future__ import annotations

from swap.tiling.plan.geometry import Window, grid, halo, receptive_extent, spans


def test_an_output_slice_needs_sigma_t_plus_delta_inputs_with_border_padding_apart() -> None:
    conv = Window(kernel=3, stride=1, pad_lo=1)  # a 3x3 'same' convolution: σ = 1, δ = 2
    assert (conv.sigma, conv.delta) == (1, 2)
    assert conv.need(0, 4, 10) == (0, 5, 1, 0)  # first tile: 1 padding position before, real ones after
    assert conv.need(4, 8, 10) == (3, 9, 0, 0)  # interior: real neighbours on both sides, T + δ = 6
    assert conv.need(8, 10, 10) == (7, 10, 0, 1)  # last tile: padding after
    pool = Window(kernel=2, stride=2, pool=True)  # σ = 2, δ = 1: T outputs read 2T inputs
    assert pool.need(3, 5, 10) == (6, 10, 0, 0)
    dilated = Window(kernel=3, stride=2, pad_lo=2, dilation=2)  # δ = dilation·(kernel - 1) = 4
    a, b, pa, pb = dilated.need(2, 5, 20)
    assert b - a + pa + pb == dilated.sigma * (5 - 2 - 1) + dilated.delta + 1


def test_a_chain_propagates_slices_backwards_and_the_halo_grows_with_depth() -> None:
    conv, pool = Window(3, 1, 1), Window(2, 2, 0, 1, True)
    chain = [conv, conv, pool, conv]
    sizes = [32, 32, 32, 16, 16]
    s = spans(chain, sizes, 4, 8)
    assert [(x.lo, x.hi) for x in s] == [(5, 19), (6, 18), (3, 9), (4, 8)]  # each op's output slice
    assert (s[0].a, s[0].b) == (4, 20)  # the chain's input slice: 4 outputs need 16 inputs
    assert receptive_extent(chain, 4) == 16
    assert halo(chain) == receptive_extent(chain, 1) - 2 and halo([conv]) == 2


def test_grid_has_at_most_two_tile_shapes() -> None:
    assert grid(10, 3) == [(0, 4), (4, 8), (8, 10)]
    assert grid(3, 8) == [(0, 1), (1, 2), (2, 3)]  # no more tiles than positions
    assert {hi - lo for lo, hi in grid(1000, 7)} == {143, 142}
