"""Which operators a segment holds, which end it, and the error when nothing fits the budget."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiling_models import Residual, vgg

import swap
from swap.tiling.plan.analyze import analyze, trace


def graph_of(model: torch.nn.Module, shape: tuple[int, ...]):
    return analyze(trace(model), (torch.empty(shape),)).graph


def test_segments_end_at_joins_training_norms_dropout_and_global_pooling() -> None:
    g = graph_of(Residual().train(), (2, 3, 16, 16))
    by_name = {n.where: n for n in g.nodes}
    assert by_name["add"].kind == "barrier" and "joins 2 activations" in by_name["add"].reason
    assert by_name["bn"].kind == "barrier" and "training mode" in by_name["bn"].reason
    assert by_name["drop"].kind == "barrier" and "mask" in by_name["drop"].reason
    assert [(g.nodes[a].where, g.nodes[b].where) for a, b in g.runs()] == [("a", "relu"), ("b", "b"), ("c", "c")]
    # in eval mode, BatchNorm (running statistics) and Dropout (identity) are pointwise: the tail is one chain
    g = graph_of(Residual().eval(), (2, 3, 16, 16))
    assert [(g.nodes[a].where, g.nodes[b].where) for a, b in g.runs()] == [("a", "relu"), ("b", "b"), ("bn", "c")]
    g = graph_of(vgg(), (1, 3, 32, 32))
    kinds = {n.where: n.kind for n in g.nodes}
    assert kinds["17"] == "barrier" and kinds["18"] == "barrier"  # adaptive pooling, flatten
    assert [(g.nodes[a].where, g.nodes[b].where) for a, b in g.runs()] == [("0", "16")]


def test_an_untileable_operator_over_the_budget_is_named_with_its_working_set() -> None:
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 2, 1, stride=4), torch.nn.Upsample(scale_factor=8))
    x = torch.randn(1, 3, 64, 64)
    with pytest.raises(swap.TilingInfeasible) as info:
        swap.tiled(model, budget=60_000)(x)
    err = info.value
    # the Upsample (module path "1") writes 2 x 128 x 128 floats (128 KiB): over the budget whatever is tiled
    assert err.op == "1" and err.working_set > 128 * 1024 and err.budget == 60_000 and err.tiles is None
    assert "Upsample is not FT-compatible" in str(err) and "`1`" in str(err)


def test_a_segment_that_cannot_shrink_further_is_named() -> None:
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU())
    with pytest.raises(swap.TilingInfeasible) as info:
        swap.tiled(model, budget=60_000)(torch.randn(1, 3, 48, 48))  # the input alone is 27 KiB, the output 72 KiB
    assert info.value.tiles is not None and info.value.working_set > 60_000
    assert "0..1" in str(info.value) and "Swap the segment boundaries" in str(info.value)


def test_only_segment_boundaries_reach_saved_tensor_hooks() -> None:
    """Note [Recompute is not swapped]: a swap runtime around the step sees the boundary, never a tile."""
    model = vgg(c=4)
    x = torch.randn(1, 3, 32, 32)
    tiled = swap.tiled(model, tiles=4)
    packed: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(tiled(x), torch.tensor([0]))
    loss.backward()
    assert (1, 3, 32, 32) in packed  # the segment's input, the boundary
    assert [s for s in packed if len(s) == 4] == [(1, 3, 32, 32)], packed  # no tile-sized tensor


def test_swap_manager_sees_segment_boundaries_as_swappable_variables() -> None:
    """A segment's boundary is a saved tensor like any other: the swap runtime records it and may move it."""
    torch.manual_seed(0)
    model = vgg(c=4)
    x, y = torch.randn(1, 3, 64, 64), torch.tensor([3])
    tiled = swap.tiled(model, budget=215_000)  # two segments: 0..9 and 10..16 (see the budget test)
    assert len(tiled.plan_for(x)[0].segments) == 2
    F.cross_entropy(tiled(x), y).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    boundary = 1 * 8 * 16 * 16 * 4  # the output of block 2 (8 channels at 16 x 16), the input of segment 10..16
    with swap.SwapManager(budget="1GiB", device="cpu", min_bytes=1024) as sm:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(tiled(x), y).backward()
    seq = sm.sequence
    assert any(size == boundary and ok for size, ok in zip(seq.sizes, seq.swappable)), seq.sizes
    for p, r in zip(model.parameters(), ref):
        assert torch.equal(p.grad, r)  # the tiled run under the swap runtime is bitwise the tiled run


def test_with_swapped_the_input_image_stays_on_the_host() -> None:
    """Note [Host inputs]: with saved tensors swapped, a budget below what the image on the device needs still
    plans when the image only feeds a tiled segment, and the run is exact. (On CPU host and device are one
    memory: the copies, and the peak they allow, need a GPU.)"""
    torch.manual_seed(0)
    model = vgg(c=4)
    x, y = torch.randn(1, 3, 96, 96), torch.tensor([3])
    # the smallest budgets the planner accepts are about 234 KiB with the image on the device and 126 KiB
    # with it on the host (the image is 108 KiB): in between, only the host plan fits
    budget = 180 * 1024
    with pytest.raises(swap.TilingInfeasible):
        swap.tiled(model, budget=budget).plan_for(x)
    tiled = swap.tiled(model, budget=budget, swapped=True)
    assert tiled.plan_for(x)[0].peak <= budget
    segment = next(m for m in tiled._built[next(iter(tiled._built))][0].modules() if hasattr(m, "tile_list"))
    assert segment.device == torch.device("cpu")  # the first segment computes where the parameters are
    F.cross_entropy(model(x), y).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    F.cross_entropy(tiled(x), y).backward()
    for p, r in zip(model.parameters(), ref):
        assert torch.allclose(p.grad, r, rtol=0, atol=2e-5 * r.abs().max().item())
