"""Recompute instead of swap: the runtime rebuilds eligible tensors bitwise exactly, and the sequence model of
the rebuild matches what the runtime records."""

import contextlib
import sys
from pathlib import Path

import pytest
import torch

import swap
from swap.forecast import zoo as models
from swap.joint.recompute import recipes, with_recompute
from swap.runtime.activations.recompute import RecomputeHooks
from swap.schedule.budget import step_floors

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "swap"))
from training import KiB, assert_bitwise_equal, run  # noqa: E402


def train_with_and_without_rebuilds(name: str) -> tuple[dict, dict, dict, dict]:
    """Trains ``name`` unmanaged, then under a quarter of the way from the step floor to the unswapped peak
    without and with rebuilds: (reference, probe run, plain, rebuilt)."""
    ref = run(name, 4)
    probe = run(name, 3, manager=lambda: swap.SwapManager(budget="64GiB", device="cpu", min_bytes=16 * KiB,
                                                           recompute=False))  # fmt: skip
    seq = probe["manager"].sequence
    floor = seq.step_floor()
    budget = floor + (seq.no_swap_peak() - floor) // 4

    def managed(recompute):
        return lambda: swap.SwapManager(budget=budget, device="cpu", min_bytes=16 * KiB, recompute=recompute)

    return ref, probe, run(name, 4, manager=managed(False)), run(name, 4, manager=managed(True))


def test_training_with_recompute_is_bitwise_equal_and_moves_fewer_bytes():
    ref, probe, plain, rebuilt = train_with_and_without_rebuilds("gpt")
    seq = probe["manager"].sequence
    assert_bitwise_equal(ref, plain)
    assert_bitwise_equal(ref, rebuilt)
    assert rebuilt["manager"].joint_view.rebuilt >= 2 * 4  # one GELU output per block (2 blocks), every iteration
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
    from swap.joint.recompute import Recipe

    out = with_recompute(seq, {2: Recipe(1, 100.0, 40.0)}, lambda r: 0.5)
    assert out.var == [0, 1, 1, 1, 0] and out.kind == ["save", "save", "use", "use", "use"]
    assert out.compute == pytest.approx([0.1, 0.2, 0.6, 0.1, 0.1])  # the dropped save's compute joins step 1
    assert out.nonswap == [1, 21, 21, 1, 1]  # forward: held until step 3; backward: the rebuilt tensor
    with pytest.raises(ValueError, match="not a kept variable"):
        with_recompute(seq, {2: Recipe(2, 1.0, 1.0)}, lambda r: 0.0)


def test_a_rebuilt_tensor_is_held_until_its_node_has_unpacked_the_rest():
    # Note [A rebuild lives as long as its node]: a node that uses the rebuilt variable 2 (step 3), then the
    # variable 0 (step 4), holds the rebuild through step 4; the node after it (step 5) does not.
    from swap.joint.recompute import Recipe

    seq = swap.Sequence([0, 1, 2, 2, 0, 1], ["save", "save", "save", "use", "use", "use"], [10, 20, 20],
                        [1, 1, 1, 1, 1, 1], [0.1] * 6, held_until=[6, 6, 3],
                        node_last=[0, 1, 2, 4, 4, 5])  # fmt: skip
    out = with_recompute(seq, {2: Recipe(1, 100.0, 40.0)}, lambda r: 0.0)
    assert out.var == [0, 1, 1, 0, 1] and out.node_last == [0, 1, 3, 3, 4]
    assert out.nonswap == [1, 21, 21, 21, 1]  # the rebuilt 20 bytes at its use and the node's next step
    assert step_floors(out)[3] == 21 + 10 + 20  # with variable 0 and the rebuild's source, which the node holds


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
    assert rebuilt["manager"].joint_view.rebuilt == 2 * 4
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
    assert got["manager"].joint_view.rebuilt == 2 * 5  # rebuilt in every iteration, declined ones included


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


# -- batch norm rebuilds (Note [Batch norm rebuilds]) ------------------------------------------------------------
def _hooked(hooks: RecomputeHooks, handles: list) -> tuple:
    def pack(t):
        h = hooks.pack(t)
        handles.append(h)
        return h if h is not None else t

    def unpack(p):
        return hooks.unpack(p, lambda q: q) if hooks.intercepts(p) else p

    return pack, unpack


def _with_update(x, bn):  # the op export and compiled graphs call; its node is BatchNormWithUpdateBackward0
    return torch.ops.aten._batch_norm_with_update(x, bn.weight, bn.bias, bn.running_mean, bn.running_var,
                                                  bn.momentum, bn.eps)[0]  # fmt: skip


@pytest.mark.parametrize("norm", ["module", "with_update"])
@pytest.mark.parametrize("relu", ["none", "relu", "relu_"])
def test_batch_norm_and_relu_outputs_are_rebuilt_bitwise_from_the_norm_input(norm, relu):
    torch.manual_seed(0)
    conv, bn, conv2 = torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Conv2d(8, 4, 1)
    act = {"none": lambda y: y, "relu": torch.relu, "relu_": torch.relu_}[relu]
    x = torch.randn(4, 3, 12, 12)

    def step(hooked: bool) -> tuple:
        for m in (conv, bn, conv2):
            m.zero_grad(set_to_none=True)
        hooks, handles = RecomputeHooks(), []
        stats = bn.running_mean.clone(), bn.running_var.clone()
        with torch.autograd.graph.saved_tensors_hooks(*_hooked(hooks, handles)) if hooked else contextlib.nullcontext():
            c = conv(x)
            y = act(bn(c) if norm == "module" else _with_update(c, bn))
            out = conv2(y).square().sum()  # conv2 saves y (and the ReLU its result): both rebuilt from c
        after_forward = bn.running_mean.clone(), bn.running_var.clone()
        out.backward()
        # The rebuild wrote scratch statistics: the module's were updated once, by the forward.
        assert torch.equal(bn.running_mean, after_forward[0]) and torch.equal(bn.running_var, after_forward[1])
        assert not torch.equal(bn.running_mean, stats[0])
        bn.running_mean.copy_(stats[0]), bn.running_var.copy_(stats[1])  # the next step starts from the same state
        grads = [p.grad.clone() for m in (conv, bn, conv2) for p in m.parameters()]
        return grads, hooks, handles

    ref, _, _ = step(False)
    got, hooks, handles = step(True)
    rebuilt = sum(h is not None for h in handles)
    assert rebuilt == (1 if relu == "none" else 2)  # conv2's input; and the ReLU's saved result
    assert hooks.rebuilt == rebuilt
    assert all(torch.equal(a, b) for a, b in zip(ref, got)), "a gradient differs"


def test_batch_norm_rebuilds_fill_no_scratch_statistics():
    """Each rebuild zero-filled two scratch running-statistic tensors (two kernels per rebuild, two rebuilds per
    conv-bn-relu, every iteration): training mode never reads them, so they are left unfilled."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Factories(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.zeros.default, torch.ops.aten.empty.memory_format, torch.ops.aten.zero_.default,
                        torch.ops.aten.fill_.Scalar) and tuple(out.shape) == (8,):  # fmt: skip
                self.made.append(func)
            return out

    torch.manual_seed(0)
    conv, bn, conv2 = torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Conv2d(8, 4, 1)
    hooks, per_step = RecomputeHooks(), []
    for _ in range(3):
        handles = []
        with torch.autograd.graph.saved_tensors_hooks(*_hooked(hooks, handles)):
            out = conv2(torch.relu(bn(conv(torch.randn(4, 3, 12, 12))))).square().sum()
        with Factories() as mode:
            out.backward()
        per_step.append(mode.made)
    assert hooks.rebuilt == 6  # two rebuilds a step: the ReLU's result and conv2's input
    # Per rebuild a running mean and variance, allocated and not filled.
    assert per_step == [[torch.ops.aten.empty.memory_format] * 4] * 3, per_step


def test_batch_norm_rebuilds_decline_eval_mode_a_frozen_bias_and_an_add_before_the_relu():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(16)
    c = torch.randn(32, 16, requires_grad=True)
    w = torch.randn(16, 4, requires_grad=True)

    def packs(f) -> list:
        hooks, handles = RecomputeHooks(), []
        with torch.autograd.graph.saved_tensors_hooks(*_hooked(hooks, handles)):
            f()
        return [h for h in handles if h is not None]

    assert len(packs(lambda: torch.relu(bn(c)) @ w)) == 2  # eligible: the ReLU's result, the mm's input
    bn.eval()
    assert packs(lambda: torch.relu(bn(c)) @ w) == []  # eval: its output follows the running statistics
    bn.train()
    bn.bias.requires_grad_(False)
    assert packs(lambda: torch.relu(bn(c)) @ w) == []  # a frozen bias: the node holds no way back to it
    bn.bias.requires_grad_(True)
    assert packs(lambda: torch.relu(bn(c) + 1.0) @ w) == []  # the ReLU reads an add, not the norm


@pytest.mark.parametrize("name,retained", [("bias", False), ("weight", True)])
def test_a_batch_norm_parameter_changed_before_the_rebuild_is_an_error_not_a_silent_difference(name, retained):
    # The rule reads the bias and weight when the output is saved, and autograd checks no versions behind
    # saved-tensor hooks: a parameter stepped in place before the rebuild (an optimizer stepping inside the
    # backward before this layer's gradient; in the first of two backwards over a retained graph) would
    # rebuild another output than the forward's, silently.
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(16)
    c = torch.randn(32, 16, requires_grad=True)
    w = torch.randn(16, 4, requires_grad=True)
    hooks, handles = RecomputeHooks(), []
    with torch.autograd.graph.saved_tensors_hooks(*_hooked(hooks, handles)):
        out = (torch.relu(bn(c)) @ w).sum()
    if retained:
        out.backward(retain_graph=True)
    with torch.no_grad():
        getattr(bn, name).add_(1.0)
    with pytest.raises(RuntimeError, match=f"{name} was changed in place"):
        out.backward()


def test_training_a_resnet_with_batch_norm_rebuilds_is_bitwise_equal_and_moves_fewer_bytes():
    ref, probe, plain, rebuilt = train_with_and_without_rebuilds("resnet")
    assert_bitwise_equal(ref, plain)
    assert_bitwise_equal(ref, rebuilt)  # gradients, losses and BatchNorm's running statistics
    assert rebuilt["manager"].joint_view.rebuilt > 0
    report, plain_report = rebuilt["manager"].report(), plain["manager"].report()
    assert report["swapped_out_bytes"] < plain_report["swapped_out_bytes"]
    # The report says what the rebuilds did; a run without them has no such rows.
    assert report["rebuilds"] == rebuilt["manager"].joint_view.rebuilt
    assert report["rebuilt_bytes"] >= 16 * KiB * report["rebuilds"]  # every candidate is at least min_bytes
    assert "rebuilt, not moved" in str(report) and "rebuilds" not in plain_report
    # The planning side finds the same candidates on the meta device: one per conv -> bn -> relu of the model.
    with torch.device("meta"):
        torch.manual_seed(0)
        net = models.resnet((1, 1, 1, 1), width=8, num_classes=10)
    x, _ = models.example_batch(net, 8, 64, None, "meta")
    found = recipes(net, (x,), min_bytes=16 * KiB)
    assert found and not set(found) & {r.source for r in found.values()}
    assert len(rebuilt["manager"].sequence.sizes) == len(probe["manager"].sequence.sizes) - len(found)


def test_the_trace_plans_the_batch_norm_rebuilds_the_runtime_makes():
    # The planner reads rebuilds off the captured operator table, where it cannot see which tensor a ReLU read
    # or an in-place add wrote; it must find exactly the candidates the runtime's rules find on a live forward
    # (conv -> bn -> relu, never the last norm of a bottleneck, whose ReLU reads the residual add).
    from swap.capture import capture
    from swap.forecast.from_trace import sequence_from_trace
    from swap.forecast.ops_from_trace import table_from_trace
    from swap.joint.regions import rebuild_recipes

    def build():
        return models.resnet((1, 1, 1, 1), width=8, num_classes=10)

    def batch(n):
        return torch.randn(n, 3, 64, 64), torch.randint(0, 10, (n,))

    tr = capture(build, batch, 4, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), target="cpu")
    seq, table = sequence_from_trace(tr, min_bytes=0), table_from_trace(tr, min_bytes=0)
    planned, _ = rebuild_recipes(seq, table)
    with torch.device("meta"):
        net = build()
    x = torch.empty(4, 3, 64, 64, device="meta")
    xs = x.untyped_storage()  # the batch is the step's input, not a saved activation, in the trace
    live = recipes(net, (x,), exclude=lambda t: t.untyped_storage() is xs, expect_sizes=seq.sizes)
    assert len(live) == 1 + 2 * 4  # the stem's, and two per bottleneck
    assert {v: r.source for v, r in planned.items()} == {v: r.source for v, r in live.items()}


@pytest.mark.parametrize("block", ["conv_bn_relu", "linear_gelu"])
def test_a_rebuild_never_reads_a_saved_input_behind_a_checkpoint(block):
    # A module checkpointed inside our hooks (a user's torch.utils.checkpoint, or one of our recompute regions)
    # whose output ends in a rebuild candidate, saved by an operator outside it: the candidate's saved input was
    # packed by the checkpoint's hooks. Peeking at it ran the checkpoint's unpack hook, which reran the module in
    # the forward and fed it our peek's empty answer (a crash). It must decline instead (Note [Whose saved input]).
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    inner = (torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
             if block == "conv_bn_relu" else torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.GELU()))  # fmt: skip
    after = torch.nn.Conv2d(8, 4, 1) if block == "conv_bn_relu" else torch.nn.Linear(8, 4)
    x = torch.randn(4, 3, 12, 12) if block == "conv_bn_relu" else torch.randn(4, 10, 12)
    runs = []
    inner[0].register_forward_hook(lambda *args: runs.append(torch.is_grad_enabled()))

    def step(hooked: bool) -> tuple:
        for m in (inner, after):
            m.zero_grad(set_to_none=True)
        hooks, handles = RecomputeHooks(), []
        with torch.autograd.graph.saved_tensors_hooks(*_hooked(hooks, handles)) if hooked else contextlib.nullcontext():
            y = checkpoint(inner, x, use_reentrant=False)
            out = after(y).square().sum()
        assert len(runs) == 1  # the checkpointed module ran once: nothing reran it in the forward
        out.backward()
        return [p.grad.clone() for m in (inner, after) for p in m.parameters()], handles

    ref, _ = step(False)
    runs.clear()
    got, handles = step(True)
    assert not any(handles), "rebuilt from a saved input that the checkpoint, not our hooks, packed"
    assert all(torch.equal(a, b) for a, b in zip(ref, got)), "a gradient differs"


def test_a_checkpointed_conv_bn_relu_block_trains_under_the_manager_with_rebuilds():
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                             torch.nn.ReLU(inplace=True))  # fmt: skip
            self.tail = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                            torch.nn.ReLU(inplace=True), torch.nn.MaxPool2d(2))  # fmt: skip
            self.head = torch.nn.Linear(8, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.tail(checkpoint(self.block, x, use_reentrant=False))
            return self.head(y.mean((2, 3)))

    def batch(model, it):
        g = torch.Generator().manual_seed(it)
        return torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)

    def pattern(model, x, y, it):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    kw = dict(build=Net, batch_fn=batch, pattern=pattern)
    ref = run("net", 3, **kw)
    got = run("net", 3, manager=lambda: swap.SwapManager(budget="64GiB", device="cpu", min_bytes=0, recompute=True),
              **kw)  # fmt: skip
    assert_bitwise_equal(ref, got)
    assert got["manager"].joint_view.rebuilt > 0  # the tail's conv -> bn -> relu outside the checkpoint still rebuilds


@pytest.mark.parametrize("backward", [True, False])
def test_batch_norm_rebuild_handles_keep_no_activation_or_module_alive(backward):
    # A Recomputed handle lives in the graph; if it (its rule, its source) held a tensor with a grad_fn, the graph
    # would hold itself through C++, a cycle the GC cannot see: a graph dropped without backward (an evaluation
    # forward with grad enabled) would never be freed. Its rule holds the norm's parameters: not the module.
    import gc
    import weakref

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(inplace=True),
                              torch.nn.Conv2d(8, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                              torch.nn.Conv2d(8, 4, 1))  # fmt: skip
    outputs: list[weakref.ref] = []
    for m in net:
        m.register_forward_hook(lambda mod, args, out: outputs.append(weakref.ref(out)))
    sm = swap.SwapManager(budget="64GiB", device="cpu", min_bytes=0, recompute=True)
    with sm:
        for _ in range(3):
            loss = net(torch.randn(4, 3, 16, 16)).square().sum()
            if backward:
                loss.backward()
            del loss
    view = sm.joint_view
    assert view.rebuilt > 0 if backward else view.rebuilding
    gc.collect()
    alive = [r for r in outputs if r() is not None]
    assert len(outputs) == 3 * len(net) and not alive, f"{len(alive)} activations kept alive"
    params, module = [weakref.ref(p) for p in net.parameters()], weakref.ref(net)
    del net, m
    gc.collect()
    assert module() is None and all(p() is None for p in params), "the manager keeps the model alive"


def test_recipes_plan_no_rebuild_from_a_checkpoints_input():
    # The planning side's peek had the same flaw (Note [Whose saved input]): on a checkpointed conv -> bn -> relu
    # it reran the block in its forward and planned the block's output rebuilt from the checkpoint's input.
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                             torch.nn.ReLU())  # fmt: skip
            self.conv2 = torch.nn.Conv2d(8, 4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv2(checkpoint(self.block, x, use_reentrant=False))

    with torch.device("meta"):
        net = Net()
    runs = []
    net.block[0].register_forward_hook(lambda *args: runs.append(1))
    x = torch.empty(2, 3, 8, 8, device="meta")
    assert recipes(net, (x,)) == {}
    assert len(runs) == 1
    net.block = torch.nn.Sequential(*net.block)  # the same layers, not checkpointed: the rebuild is planned
    net.forward = lambda x: net.conv2(net.block(x))
    assert len(recipes(net, (x,))) == 1
