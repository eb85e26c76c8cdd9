"""Recompute instead of swap: the runtime rebuilds eligible tensors bitwise exactly, and the sequence model of
the rebuild matches what the runtime records."""

import sys
from pathlib import Path

import pytest
import torch

import swap
from bench import models
from swap.planning.recompute import recipes, with_recompute
from swap.runtime.recompute import RecomputeHooks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "swap"))
from training import KiB, assert_bitwise_equal, run  # noqa: E402


def test_training_with_recompute_is_bitwise_equal_and_moves_fewer_bytes():
    ref = run("gpt", 4)
    probe = run("gpt", 3, manager=lambda: swap.SwapManager(budget="64GiB", device="cpu", min_bytes=16 * KiB))
    seq = probe["manager"].sequence
    floor = seq.step_floor()
    budget = floor + (seq.no_swap_peak() - floor) // 4

    def managed(recompute):
        return lambda: swap.SwapManager(budget=budget, device="cpu", min_bytes=16 * KiB, recompute=recompute)

    plain, rebuilt = run("gpt", 4, manager=managed(False)), run("gpt", 4, manager=managed(True))
    assert_bitwise_equal(ref, plain)
    assert_bitwise_equal(ref, rebuilt)
    hooks = rebuilt["manager"]._recompute
    assert hooks.rebuilt >= 2 * 4  # one GELU output per block (2 blocks), every iteration
    r_plain, r_rebuilt = plain["manager"].report(), rebuilt["manager"].report()
    assert r_rebuilt["swapped_out_bytes"] < r_plain["swapped_out_bytes"]
    # The runtime's recorded sequence is the model's: fewer variables, the rebuilt ones' uses read the source.
    assert len(rebuilt["manager"].sequence.sizes) == len(seq.sizes) - 2


def test_rebuild_is_bitwise_equal_for_every_rule():
    x = torch.randn(64, 32, dtype=torch.float64)
    for f in (torch.nn.functional.gelu, lambda u: torch.nn.functional.gelu(u, approximate="tanh"),
              torch.nn.functional.silu, lambda u: torch.nn.functional.leaky_relu(u, 0.2)):  # fmt: skip
        u = (x * 1.0).requires_grad_()
        hooks = RecomputeHooks()
        handles = []

        def pack(t, hooks=hooks, handles=handles):
            h = hooks.pack(t)
            handles.append(h)
            return h if h is not None else t

        def unpack(p, hooks=hooks):
            return hooks.unpack(p, lambda q: q) if hooks.intercepts(p) else p

        w = torch.randn(64, 8, dtype=torch.float64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = f(u)
            out = (y.t() @ w).sum()  # mm saves a transposed view of y for w's gradient: rebuilt as that view
        assert sum(h is not None for h in handles) == 1
        out.backward()
        ref_u, ref_w = (x * 1.0).requires_grad_(), w.detach().clone().requires_grad_()
        (f(ref_u).t() @ ref_w).sum().backward()
        assert torch.equal(u.grad, ref_u.grad) and torch.equal(w.grad, ref_w.grad) and hooks.rebuilt == 1


def test_sequence_model_of_the_rebuild():
    with torch.device("meta"):
        net = models.gpt(n_layer=2, n_head=4, d_model=64, vocab=256, seq_len=64)
    x, _ = models.example_batch(net, 8, 64, None, "meta")
    xs = x.untyped_storage()
    found = recipes(net, (x,), exclude=lambda t: t.untyped_storage() is xs)
    assert len(found) == 2 and all(r.source < v for v, r in found.items())
    seq = swap.Sequence([0, 1, 2, 2, 1, 0], ["save", "save", "save", "use", "use", "use"], [10, 20, 20],
                        [1, 1, 1, 1, 1, 1], [0.1] * 6, held_until=[6, 6, 3])  # fmt: skip
    from swap.planning.recompute import Recipe

    out = with_recompute(seq, {2: Recipe(1, 100.0, 40.0)}, lambda r: 0.5)
    assert out.var == [0, 1, 1, 1, 0] and out.kind == ["save", "save", "use", "use", "use"]
    assert out.compute == pytest.approx([0.1, 0.2, 0.6, 0.1, 0.1])  # the dropped save's compute joins step 1
    assert out.nonswap == [1, 21, 21, 1, 1]  # forward: held until step 3; backward: the rebuilt tensor
    with pytest.raises(ValueError, match="not a kept variable"):
        with_recompute(seq, {2: Recipe(2, 1.0, 1.0)}, lambda r: 0.0)


def gelu_chain() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.GELU(), torch.nn.GELU(),
                               torch.nn.Linear(256, 64))  # fmt: skip


def chain_batch(model: torch.nn.Module, it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(it)
    return torch.randn(1024, 64, generator=g), torch.randn(1024, 64, generator=g)


def mse(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, it: int) -> torch.Tensor:
    loss = (model(x) - y).square().mean()
    loss.backward()
    return loss


def test_a_rebuild_whose_input_is_rebuilt_is_declined_and_gradients_stay_bitwise_equal():
    # gelu(gelu(gelu(u))): each GELU's input is the previous one's output (Note [No rebuild from a rebuild]).
    # The first output is rebuilt from u, the second (whose input is rebuilt) is swapped, the third is rebuilt
    # from the second. Before the fix the second's rebuild got the first's handle instead of a tensor.
    kw = dict(build=gelu_chain, batch_fn=chain_batch, pattern=mse)
    ref = run("chain", 4, **kw)
    rebuilt = run("chain", 4, manager=lambda: swap.SwapManager(budget="5MiB", device="cpu", min_bytes=0,
                                                              recompute=True), **kw)  # fmt: skip
    assert_bitwise_equal(ref, rebuilt)
    assert rebuilt["manager"].report()["status"] == "planned"  # profiled twice, then two planned iterations
    assert rebuilt["manager"]._recompute.rebuilt == 2 * 4
    # The planning side declines the same candidate: two recipes, each from a variable that is kept.
    torch.manual_seed(0)
    net = gelu_chain()
    x, _ = chain_batch(net, 0)
    found = recipes(net, (x,))
    assert len(found) == 2 and not set(found) & {r.source for r in found.values()}


def test_a_run_that_fits_with_its_rebuilds_keeps_rebuilding_and_stays_within_the_budget():
    # Profiling rebuilds GELU outputs instead of keeping them, so a budget can fit the profiled run and not
    # an unswapped run that keeps them. Declining to swap used to drop the rebuilds as well: the next
    # iteration went over the budget (6.07 MiB of 6 MiB here), warned and profiled again, every few
    # iterations (Note [Recompute or swap]).
    import gc
    import warnings

    kw = dict(build=gelu_chain, batch_fn=chain_batch, pattern=mse)
    ref = run("chain", 5, **kw)
    gc.collect()  # earlier tests' tensors would count as live in the CPU meter's budget
    with warnings.catch_warnings():
        warnings.simplefilter("error", swap.BudgetWarning)
        got = run("chain", 5, manager=lambda: swap.SwapManager(budget="6MiB", device="cpu", min_bytes=0,
                                                              recompute=True), **kw)  # fmt: skip
    assert_bitwise_equal(ref, got)
    report = got["manager"].report()
    assert report["status"] == "declined" and report["overruns"] == 0, report
    assert report["peak_device_bytes"] <= report["budget_bytes"]
    assert got["manager"]._recompute.rebuilt == 2 * 5  # rebuilt in every iteration, declined ones included


def test_recipes_leaves_no_activation_alive():
    # recipes() runs the forward for real; a saved handle left in its unpack hook's closure kept its tensor and,
    # through the graph that holds that hook, every activation alive for good (a cycle through C++).
    import weakref

    torch.manual_seed(0)
    net = gelu_chain()
    outputs: list[weakref.ref] = []
    for m in net:
        m.register_forward_hook(lambda mod, args, out: outputs.append(weakref.ref(out)))
    x, _ = chain_batch(net, 0)
    assert len(recipes(net, (x,))) == 2
    assert len(outputs) == len(net) and all(r() is None for r in outputs), "recipes() kept activations alive"
