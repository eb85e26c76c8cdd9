"""strategy="auto" in the runtime: the manager checkpoints modules it chose, keeps and swaps what the plan says,
and training stays bitwise equal (losses, gradients, BatchNorm statistics) and within the budget."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import swap
from swap.joint.regions import RecomputePlan, Region
from swap.joint.search import BASELINES, JointResult, Strategy, search

sys.path.insert(0, str(Path(__file__).resolve().parent))
from third_party import run_kwargs  # noqa: E402
from training import KiB, assert_bitwise_equal, assert_within, run  # noqa: E402

SLOW_LINK = 1e6  # bytes/s: copies cost more than recomputing (CPU convolutions are slow here), so the plan checkpoints


def manager(budget: int, choose=None, **kw) -> swap.SwapManager:
    sm = swap.SwapManager(budget=budget, device="cpu", min_bytes=16 * KiB, **kw)
    if choose is not None:
        sm._joint.choose = choose
    return sm


def on_slow_link(ev):
    ev.h2d = ev.d2h = SLOW_LINK
    return search(ev)


def fixed(name: str, swap_policy: str = "window"):
    """A baseline's plan instead of the search (its regions, swapping what is left with ``swap_policy``)."""

    def choose(ev):
        o = BASELINES[name](ev)
        return JointResult(ev.evaluate(Strategy(name, o.strategy.plan, swap_policy)), {}, ev.evaluations)

    return choose


def unswapped_peak(ref: dict) -> int:
    return max(ref["peaks"])


# (model, budget as a fraction of its unswapped peak): below what checkpointing alone reaches, above the floor
# of swapping alone, so the plan on a slow link checkpoints blocks (and swaps what is left over, if any).
CASES = [("gpt2", 0.45), ("bert", 0.5), ("t5", 0.55), ("llama", 0.5), ("vit", 0.55), ("resnet_bn", 0.62)]


@pytest.mark.parametrize("name,fraction", CASES)
def test_auto_checkpoints_and_swaps_third_party_models_bitwise_within_the_budget(name, fraction):
    kw = run_kwargs(name)
    ref = run(name, 4, meter=swap.LiveBytesMeter("cpu"), **kw)
    budget = int(unswapped_peak(ref) * fraction)
    got = run(name, 4, manager=lambda: manager(budget, on_slow_link), meter=swap.LiveBytesMeter("cpu"), **kw)
    assert_bitwise_equal(ref, got)  # losses, gradients, buffers (BatchNorm's running statistics)
    assert_within(got["peaks"], budget)  # every iteration, the profiling ones included
    report = got["manager"].report()
    assert "region" in report["recompute_plan"], report["recompute_plan"]
    sm = got["manager"]
    assert report["status"] == "planned", dict(report)
    # Whatever it copies out it drops (Note [Copies nothing needs]): where checkpointing leaves room, nothing.
    s = sm.schedule
    assert {v for step in s.swap_out for v in step} <= {v for step in s.release for v in step}, dict(report)
    rows = [r for r in report["modules"] if r["recomputed_bytes"] > 0]
    assert rows and all(r["recompute_seconds"] > 0 and r["reruns"] >= 2 for r in rows)


def test_batchnorm_statistics_are_updated_once_by_a_rerun():
    kw = run_kwargs("resnet_bn")
    ref = run("resnet_bn", 4, meter=swap.LiveBytesMeter("cpu"), **kw)
    budget = int(unswapped_peak(ref) * 0.9)
    got = run("resnet_bn", 4, manager=lambda: manager(budget, fixed("checkpoint")), **kw)
    sm = got["manager"]
    stats = sm.joint_view.regions
    assert sum(s.scratch for s in stats.values()) > 0  # the reruns wrote BatchNorm statistics on scratch copies
    assert_bitwise_equal(ref, got)  # running_mean, running_var and num_batches_tracked included


class Noisy(nn.Module):
    """A block whose noise comes from its own generator, with a host sync: neither can be rerun."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.g = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc(x))
        h = h * (torch.rand(h.shape, generator=self.g) > 0.1)  # a generator checkpoint cannot replay
        scale = 1.0 + 0.0 * h.abs().max().item()  # a host sync
        return x + self.out(F.dropout(h, 0.1)) * scale


def noisy_model() -> nn.Module:
    return nn.Sequential(*[Noisy() for _ in range(3)])


def noisy_batch(model, it):
    g = torch.Generator().manual_seed(it)
    return torch.randn(512, 64, generator=g), torch.randn(512, 64, generator=g)


def mse(model, x, y, it):
    loss = (model(x) - y).square().mean()
    loss.backward()
    return loss


def test_operators_that_cannot_be_rerun_are_kept_and_the_report_says_why():
    kw = dict(build=noisy_model, batch_fn=noisy_batch, pattern=mse)
    ref = run("noisy", 4, meter=swap.LiveBytesMeter("cpu"), **kw)
    budget = int(unswapped_peak(ref) * 0.9)
    got = run("noisy", 4, manager=lambda: manager(budget, fixed("checkpoint")), **kw)
    assert_bitwise_equal(ref, got)  # the kept draw is not drawn again; the default generator is replayed
    rows = {r["module"]: r for r in got["manager"].report()["modules"]}
    why = rows["0"]["kept_because"]
    assert any("torch.Generator" in w for w in why.values()), why
    assert any(".item()" in w for w in why.values()), why
    assert not any("dropout" in k or "bernoulli" in k for k in why)  # the default generator's draw is rerun
    # The report lists them per module with the reason, per profiled iteration, and prints them.
    report = got["manager"].report()
    listed = {(r["module"], r["why"].split(" (")[0]): r["count"] for r in report["not_recomputable"]}
    for path in ("0", "1", "2"):
        assert listed[path, "draws from a torch.Generator of its own"] == 1, listed
        assert listed[path, "a host sync that reads a value"] == 1, listed
    assert "a host sync that reads a value (.item())" in str(report)


class WritesItsInput(nn.Module):
    """A block that rectifies its input in place: a checkpoint of it would find its saved input modified."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.relu_()
        return x + self.fc(x)


def test_a_module_that_writes_its_input_in_place_is_not_checkpointed_and_the_report_says_why():
    kw = dict(build=lambda: nn.Sequential(*[WritesItsInput() for _ in range(3)]), batch_fn=noisy_batch, pattern=mse)
    ref = run("in_place", 4, meter=swap.LiveBytesMeter("cpu"), **kw)
    budget = int(unswapped_peak(ref) * 0.9)
    got = run("in_place", 4, manager=lambda: manager(budget, fixed("checkpoint")), **kw)
    assert_bitwise_equal(ref, got)
    report = got["manager"].report()
    assert report["status"] == "planned", dict(report)  # it had to act, and swapped instead
    blocked = report["not_checkpointed"]
    assert set(blocked) == {"0", "1", "2"}, blocked
    assert all("aten.relu_.default writes one of its inputs in place" in why for why in blocked.values()), blocked
    assert not got["manager"].joint_view.applied
    assert "modules never checkpointed" in str(report)


def test_non_deterministic_cuda_kernels_cannot_be_rerun_unless_deterministic_algorithms_are_on():
    from swap.runtime.auto.op_facts import blocker

    index_add, cuda = torch.ops.aten.index_add.default, torch.device("cuda")
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert "non-deterministic CUDA kernel" in blocker(index_add, (), {}, cuda)
        assert blocker(index_add, (), {}, torch.device("cpu")) == ""  # CPU kernels are deterministic
        assert blocker(torch.ops.aten.mm.default, (), {}, cuda) == ""
        torch.use_deterministic_algorithms(True)
        assert blocker(index_add, (), {}, cuda) == ""
    finally:
        torch.use_deterministic_algorithms(was)


@pytest.mark.parametrize("op", ["nll_loss2d_forward.default", "index_copy.default", "index_copy_.default",
                                "scatter.src", "scatter_.value", "scatter.reduce"])
def test_atomic_writes_on_cuda_are_not_rerun(op):
    # The 2-d NLL loss's weight sum, index_copy and scatter with duplicate indices are not deterministic on CUDA;
    # they were rerun by a checkpoint (bitwise only by chance).
    from swap.runtime.auto.op_facts import blocker

    packet, overload = op.split(".")
    func = getattr(getattr(torch.ops.aten, packet), overload)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert "non-deterministic CUDA kernel" in blocker(func, (), {}, torch.device("cuda"))
        assert blocker(func, (), {}, torch.device("cpu")) == ""
    finally:
        torch.use_deterministic_algorithms(was)


def test_a_users_own_checkpoint_keeps_working_and_is_not_wrapped_again():
    from torch.utils.checkpoint import checkpoint

    def wrap(model):
        for block in model.blocks:
            inner = block.forward
            block.forward = lambda x, inner=inner: checkpoint(inner, x, use_reentrant=False)
        return model

    ref = run("gpt", 4, wrap=wrap)
    got = run("gpt", 4, wrap=wrap, manager=lambda: manager(1 << 30))
    assert_bitwise_equal(ref, got)
    joint = got["manager"].joint_view
    assert not joint.applied
    assert "of your own" in joint.table.blocked("blocks.0") and "of your own" in joint.table.blocked("blocks.1")


def test_modules_are_unwrapped_on_exit_and_after_an_exception():
    torch.manual_seed(0)
    from swap.forecast import zoo as models

    model = models.gpt(n_layer=2, n_head=4, d_model=64, vocab=256, seq_len=64)
    x, y = models.example_batch(model, 8, 64, torch.Generator().manual_seed(0))
    sm = manager(6 << 20, fixed("checkpoint"))  # below its peak without swapping (7.8 MiB)
    with pytest.raises(KeyError):
        with sm:
            for it in range(4):
                models.loss_fn(model, model(x), y).backward()
                if it == 2:
                    assert all("forward" in b.__dict__ for b in model.blocks)  # wrapped by the manager
                    raise KeyError("the user's own error")
    assert not any("forward" in b.__dict__ for b in model.blocks)
    models.loss_fn(model, model(x), y).backward()  # the model still trains as written


def test_the_sequence_model_matches_what_the_runtime_records_and_auto_wins_on_it():
    # A forced plan (full checkpointing, and selective) on the zoo GPT: the sequence with_regions predicts from
    # the profile is the one the re-profiled iteration records, step for step; its memory within 20 %.
    from swap.joint.regions import with_regions

    ref = run("gpt", 4, meter=swap.LiveBytesMeter("cpu"))
    budget = int(unswapped_peak(ref) * 0.7)
    for name in ("checkpoint", "selective"):
        seen = {}

        def choose(ev, name=name, seen=seen):
            seen["ev"] = ev
            return fixed(name)(ev)

        got = run("gpt", 4, manager=lambda choose=choose: manager(budget, choose))
        assert_bitwise_equal(ref, got)
        ev = seen["ev"]
        plan = got["manager"].joint_view.result.best.strategy.plan
        model, real = with_regions(ev.seq, ev.table, plan), got["manager"].sequence
        assert (model.var, model.kind, model.sizes) == (real.var, real.kind, real.sizes), name
        assert (model.freed, model.node_last) == (real.freed, real.node_last), name
        assert abs(model.no_swap_peak() - real.no_swap_peak()) <= 0.2 * real.no_swap_peak(), name
        # The joint strategy on this real profile: never slower than a baseline.
        result = search(ev)
        for b, o in result.baselines.items():
            assert not o.feasible or result.best.step_time <= o.step_time, b


def test_a_plan_that_does_not_fit_is_reported_and_the_manager_swaps_only():
    from swap.joint.search import Outcome

    def infeasible(ev):
        return JointResult(Outcome(Strategy("checkpoint_window"), False, float("inf"), "the rerun of blocks.0 is over"),
                           {}, ev.evaluations)  # fmt: skip

    ref = run("gpt", 4, meter=swap.LiveBytesMeter("cpu"))
    budget = int(unswapped_peak(ref) * 0.7)
    got = run("gpt", 4, manager=lambda: manager(budget, infeasible), meter=swap.LiveBytesMeter("cpu"))
    assert_bitwise_equal(ref, got)
    assert_within(got["peaks"], budget)
    report = got["manager"].report()
    assert report["recompute_plan"] == "none (checkpoint_window does not fit the budget: swapping only)"
    assert any("the rerun of blocks.0 is over" in n for n in report["notes"]), report["notes"]
    assert report["status"] == "planned" and not got["manager"].joint_view.applied


def test_the_operator_profiler_leaves_the_dispatch_stack_when_profiling_ends_with_nothing_to_manage():
    """Saved tensors all under min_bytes: the manager has nothing to plan, so after its profiling iterations no
    operator is profiled any more (a profiler left on taxed every later step ~10x on CPU)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from swap.runtime.auto.op_profiler import OpProfiler

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    profiling = []
    with manager(1 << 30) as sm:
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            opt.step()
            profiling.append(any(isinstance(m, OpProfiler) for m in _get_current_dispatch_mode_stack()))
    assert profiling[0] and not any(profiling[2:]), profiling
    assert sm.report()["declined"]


def _conv_bn_relu(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


def conv_bn_relu_model() -> nn.Module:
    return nn.Sequential(_conv_bn_relu(3, 4), nn.MaxPool2d(2), _conv_bn_relu(4, 16), _conv_bn_relu(16, 16),
                         _conv_bn_relu(16, 16), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))  # fmt: skip


def image_batch(model, it):
    g = torch.Generator().manual_seed(it)
    return torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)


def test_a_region_ending_in_batch_norm_and_relu_trains_with_rebuilds_on():
    # The region's output (its ReLU's, on its batch norm) is saved outside it, by the max pool: a rebuild
    # candidate whose norm saved its input through the region's checkpoint. The rebuild's peek ran the
    # checkpoint's unpack in the forward and crashed (Note [Whose saved input]); it must decline, and the
    # second block, outside any region, still rebuilds.
    kw = dict(build=conv_bn_relu_model, batch_fn=image_batch)  # the standard pattern: cross entropy
    ref = run("cbr", 4, meter=swap.LiveBytesMeter("cpu"), **kw)
    budget = int(unswapped_peak(ref) * 0.9)

    def choose(ev):
        plan = RecomputePlan((Region("0"),), rebuild=True)
        return JointResult(ev.evaluate(Strategy("region 0, rebuilds", plan, "window")), {}, ev.evaluations)

    got = run("cbr", 4, manager=lambda: manager(budget, choose), **kw)
    assert_bitwise_equal(ref, got)
    sm = got["manager"]
    assert sm.report()["recompute_plan"] == "1 region(s), 0 kept operator(s), rebuilds"
    view = sm.joint_view
    assert view.regions["0"].reruns > 0 and view.rebuilt > 0


def test_the_profilers_own_time_does_not_inflate_the_calibrated_prices(monkeypatch):
    # Note [Our own time is not the model's]: the step timers measured the operator profiler's bookkeeping with
    # the model's compute, and the operator table (scaled to the measured forward on a GPU) priced every
    # operator by it. A profiler made 3 ms slower per operator must price the forward as before.
    import time

    from swap.joint.ops import calibrated
    from swap.runtime.auto import op_profiler

    ref = run("gpt", 3, meter=swap.LiveBytesMeter("cpu"))
    budget = int(unswapped_peak(ref) * 0.7)

    def forward_price(delay: float) -> tuple[float, int]:
        seen = {}

        def choose(ev):
            seen["ev"] = ev
            return search(ev)

        real = op_profiler.element_flops
        monkeypatch.setattr(op_profiler, "element_flops", lambda *a: time.sleep(delay) or real(*a))
        run("gpt", 3, manager=lambda: manager(budget, choose))
        monkeypatch.setattr(op_profiler, "element_flops", real)
        seq, table = seen["ev"].seq, seen["ev"].table
        first_use = seq.kind.index("use")
        return sum(op.seconds for op in calibrated(table, sum(seq.compute[:first_use])).ops), len(table.ops)

    plain, n = forward_price(0.0)
    slowed, _ = forward_price(0.003)
    assert n * 0.003 > 2 * plain  # the delay would dominate the forward if it were counted
    assert slowed < plain + n * 0.003 / 4, (plain, slowed, n)
