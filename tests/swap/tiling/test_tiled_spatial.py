"""Spatial tiling is exact: losses, parameter and input gradients match the untiled run.

Note [Tiled gradient tolerance]
Bitwise equality cannot hold: a tiled weight gradient is a sum over tiles of per-tile sums, the untiled one a
single sum, and floating-point addition is not associative; input-gradient tiles add where halos overlap.
Every term is computed from the same values (Note [Exact borders], Note [Backward halo]), so the only error
is the order of the sums. The tolerance per tensor is relative to its largest element:
  - float64: |tiled - untiled| <= 1e-10 * max|untiled| (a wrong halo or border shows at 1e-2 and above);
  - float32: |tiled - untiled| <= 2e-5 * max|untiled|: a sum of n terms reordered errs by about
    sqrt(n) * 2^-24 (6e-8) relative, n up to 4096 positions here (~4e-6), with margin for cancellation.
    Larger images sum more positions: bench/tiling_cpu.py checks max(2e-5, 4 * sqrt(n) * 2^-24).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tiling_models import Mixed2d, assert_close, chain1d, chain3d, vgg

import swap
from swap.tiling.run.model import TiledModel


def compare(model: torch.nn.Module, shape: tuple[int, ...], dtype: torch.dtype, **tiling) -> TiledModel:
    """Runs a loss over ``model`` and over its tiled copy; checks loss, input and parameter gradients."""
    torch.manual_seed(0)
    model = model.to(dtype)
    twin = copy.deepcopy(model)
    tiled = swap.tiled(twin, **tiling)
    x = torch.randn(shape, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out1, out2 = model(x1), tiled(x2)
    w = torch.randn_like(out1)  # a loss whose gradient differs at every output element
    loss1, loss2 = (out1 * w).sum(), (out2 * w).sum()
    loss1.backward()
    loss2.backward()
    assert_close(out2.detach(), out1.detach(), "output")
    assert_close(x2.grad, x1.grad, "input gradient")
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert q.grad is not None, f"{name} got no gradient through the tiles"
        assert_close(q.grad, p.grad, f"gradient of {name}")
    return tiled


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("tiles", [3, (2, 5)])
def test_mixed_2d_chain_matches_untiled(dtype: torch.dtype, tiles) -> None:
    model = Mixed2d().eval()  # eval: BatchNorm uses running statistics, which tile exactly
    model.bn.running_mean.uniform_(-1, 1)
    model.bn.running_var.uniform_(0.5, 2)
    tiled = compare(model, (2, 3, 37, 29), dtype, tiles=tiles)
    plan = tiled.last_plan
    assert len(plan.segments) == 1 and plan.segments[0].count > 1
    graph = tiled.plan_for(torch.empty(2, 3, 37, 29, dtype=dtype))[1].graph
    seg = plan.segments[0]
    assert [graph.nodes[seg.start].where, graph.nodes[seg.end].where] == ["conv1", ".relu()"]  # up to global pooling


def test_1d_and_3d_chains_match_untiled() -> None:
    compare(chain1d(), (2, 2, 67), torch.float64, tiles=4)
    compare(chain3d(), (1, 1, 12, 10, 9), torch.float64, tiles=(2, 3, 2))


def measure(step, tensors: list[torch.Tensor]) -> int:
    """The peak live bytes of ``step()`` on CPU, counting ``tensors`` (what the step holds from before)."""
    with swap.LiveBytesMeter() as meter:
        meter.track(tensors)
        step()
    return meter.peak


def test_budget_plan_holds_the_measured_peak_and_matches() -> None:
    model = vgg(c=4)
    x = torch.randn(1, 3, 64, 64)
    y = torch.tensor([3])
    untiled = measure(lambda: F.cross_entropy(model(x), y).backward(), [*model.parameters(), x])
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    budget = untiled // 2
    held = sum(r.numel() * r.element_size() for r in ref)  # the reference gradients stay live: tell the planner
    tiled = swap.tiled(model, budget=budget, extra=held)
    peak = measure(lambda: F.cross_entropy(tiled(x), y).backward(), [*model.parameters(), x, *ref])
    assert peak <= budget, f"measured {peak} over the budget {budget} (untiled {untiled})"
    assert tiled.last_plan.peak <= budget and tiled.last_plan.segments[0].count > 1
    for p, r in zip(model.parameters(), ref):
        assert_close(p.grad, r, "gradient")


def test_live_memory_is_flat_over_tiles_and_iterations() -> None:
    """Note [One buffer per tile shape]: every tile frees what it allocated before the next one starts, so the
    live bytes after each tile are the same, and each iteration reaches the same peak."""
    model = vgg(c=4)
    x, y = torch.randn(1, 3, 64, 64), torch.tensor([1])
    meter = swap.LiveBytesMeter()
    after: dict[str, list[int]] = {}

    def record(msg: str) -> None:  # "forward tile 3/16": the live bytes after that tile
        after.setdefault(msg.split(" tile")[0], []).append(meter.live)

    tiled = swap.tiled(model, tiles=4, progress=record)
    peaks = []
    with meter:
        meter.track([*model.parameters(), x])
        for _ in range(3):
            after.clear()
            meter.reset_window()
            F.cross_entropy(tiled(x), y).backward()
            peaks.append(meter.window_peak)
            # a segment of 16 tiles: live bytes after each tile (the first backward tile allocates the input
            # gradient and the weight-gradient accumulators that the others add into)
            assert len(set(after["forward"])) == 1, after["forward"]
            assert len(set(after["backward"][1:])) == 1, after["backward"]
    assert len(after["backward"]) == 16
    assert peaks[1] == peaks[2], peaks  # the first iteration also allocates the .grad of every parameter


def test_fixed_input_shape_is_replanned_per_shape() -> None:
    tiled = swap.tiled(chain1d().double(), tiles=3)
    for n in (40, 53):
        x = torch.randn(1, 2, n, dtype=torch.float64)
        assert torch.allclose(tiled(x), tiled.model(x), rtol=0, atol=1e-12)
    assert len(tiled._built) == 2


def test_bad_arguments_get_clear_errors() -> None:
    with pytest.raises(ValueError, match="budget="):
        swap.tiled(vgg())
    with pytest.raises(ValueError, match="budget"):
        swap.tiled(vgg(), budget="lots")
    with pytest.raises(TypeError, match="nn.Module"):
        swap.tiled(lambda x: x, budget=100)
    with pytest.raises(ValueError, match="spatial dimensions"):
        swap.tiled(vgg(), tiles=(2, 2, 2))(torch.randn(1, 3, 16, 16))


def test_backward_recomputes_under_the_forward_autocast() -> None:
    """Note [Recompute under the forward's autocast]: the backward's convolutions run in bfloat16, as the
    forward's did, and the gradients match the untiled run under the same autocast."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ConvDtypes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.dtypes: set[torch.dtype] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.convolution.default:
                self.dtypes.add(out.dtype)
            return out

    torch.manual_seed(0)
    model = vgg(c=4)
    twin = copy.deepcopy(model)
    tiled = swap.tiled(twin, tiles=3)
    x, y = torch.randn(1, 3, 32, 32), torch.tensor([2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss1, loss2 = F.cross_entropy(model(x), y), F.cross_entropy(tiled(x), y)
    loss1.backward()
    with ConvDtypes() as seen:
        loss2.backward()
    assert seen.dtypes == {torch.bfloat16}, seen.dtypes  # the recomputed tiles' convolutions
    assert abs(loss1.item() - loss2.item()) <= 1e-2 * abs(loss1.item())
    for p, q in zip(model.parameters(), twin.parameters()):
        assert (p.grad - q.grad).abs().max() <= 5e-2 * p.grad.abs().max()  # bfloat16 rounding, summed apart


@pytest.mark.parametrize("name", ["resnet-train", "unet-eval"])
def test_residual_and_skip_networks_tile_between_their_joins(name: str) -> None:
    """Residual adds and U-Net concatenations end segments; training-mode BatchNorm runs untiled between them."""
    from swap.forecast import zoo

    if name == "resnet-train":
        model, shape = zoo.resnet((1, 1, 1, 1), width=8, num_classes=10), (2, 3, 48, 48)
    else:
        model, shape = zoo.unet(depth=2, width=8).eval(), (1, 3, 32, 32)
    tiled = compare(model, shape, torch.float64, tiles=2)
    assert len(tiled.last_plan.segments) >= 5


def test_tiles_copied_from_another_device_compute_the_same(monkeypatch) -> None:
    """Note [Host inputs]: the path where each tile's slice is copied to the compute device and its input
    gradient copied back (forced here: on CPU the two devices are one)."""
    from swap.tiling.run.function import Tiling

    monkeypatch.setattr(Tiling, "moves", lambda self, x: True)
    compare(chain1d(), (2, 2, 67), torch.float64, tiles=4, swapped=True)
