"""The manager never does nothing silently: when it cannot move what the budget needs moved it warns once
with swap.BudgetWarning naming the cause; when the run fits it declines (at any budget at or above what the
run needs without swapping); a report taken before any iteration says so."""

import contextlib
import functools
import gc
import re
import warnings

import pytest
import torch
from training import KiB, assert_bitwise_equal, assert_within, run

import swap
from swap.units import fmt_bytes


@functools.cache
def reference(name: str = "gpt"):
    return run(name, 4, meter=swap.LiveBytesMeter("cpu"))


def budget_warnings(**kwargs):
    """Runs gpt at 60% of its unswapped peak with the given manager arguments; returns the BudgetWarnings."""
    budget = int(max(reference()["peaks"]) * 0.6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run("gpt", 4, manager=lambda: swap.SwapManager(budget=budget, **kwargs))
    assert_bitwise_equal(reference(), got)
    found = [str(w.message) for w in caught if issubclass(w.category, swap.BudgetWarning)]
    return found, got["manager"].report()


@pytest.mark.parametrize(
    "kwargs, cause",
    [
        ({"device": "cpu:1"}, r"on cpu, none on the manager's device cpu:1: nothing is managed.*device='cpu'"),
        ({"device": "cpu", "min_bytes": "100GiB"}, r"nothing can be swapped.*smaller than min_bytes=107374182400"),
        ({"device": "cpu", "min_bytes": 0, "exclude": lambda t: True}, r"nothing can be swapped.*matched by exclude="),
    ],
)
def test_nothing_to_manage_warns_once_naming_the_cause(kwargs, cause):
    found, report = budget_warnings(**kwargs)
    # Once, not per iteration; once more with the figure the run reaches once the optimizer has state (Note [The
    # figure a warning quotes]).
    assert 1 <= len(found) <= 2 and all(re.search(cause, w) for w in found), found
    assert len(found) == 1 or "warned before" in found[1], found
    assert any(found[-1][len("swap: "):] in n for n in report["notes"])  # and the report keeps it


class PreNormMLP(torch.nn.Module):
    """One block of an MLP-Mixer: x + fc2(gelu(fc1(layer_norm(x))))."""

    def __init__(self, d: int = 256, hidden: int = 512) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1, self.fc2 = torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


BLOCKS = {
    "mixer": lambda: torch.nn.Sequential(*[PreNormMLP() for _ in range(12)]),
    "mlp": lambda: torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                                             torch.nn.Linear(512, 256)) for _ in range(6)]),
}  # fmt: skip


def train_accumulating(name: str, manager=None, meter=None, iterations: int = 4, micro: int = 2):
    """AdamW over ``micro`` micro-batches (8x64x256) per step; returns the manager and the model."""
    torch.manual_seed(0)
    model = BLOCKS[name]()
    opt = torch.optim.AdamW(model.parameters())
    sm = manager() if manager else None
    with contextlib.ExitStack() as stack:
        if meter is not None:
            stack.enter_context(meter.track_existing())
        if sm is not None:
            stack.enter_context(sm)
        for it in range(iterations):
            for m in range(micro):
                x = torch.randn(8, 64, 256, generator=torch.Generator().manual_seed(it * micro + m))
                model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return sm, model


@pytest.mark.parametrize("name", ["mixer", "mlp"])
def test_memory_grown_after_profiling_with_nothing_to_move_warns(name):
    # With gradient accumulation the two profiled iterations are micro-batches that run before
    # AdamW has made its state; the run goes over the budget only after them. The warning was judged at the
    # profiles alone, so the run went over the budget without a word (Note [Nothing to move, over the budget]).
    meter = swap.LiveBytesMeter("cpu")
    _, model = train_accumulating(name, meter=meter)
    static = 4 * sum(p.nbytes for p in model.parameters())  # weights, gradients, AdamW's two moments
    budget = (static + meter.peak) // 2
    del model  # live tensors count against the budget on CPU
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sm, model = train_accumulating(name, manager=lambda: swap.SwapManager(budget=budget, device="cpu",
                                                                          min_bytes="100GiB"))  # fmt: skip
    found = [str(w.message) for w in caught if issubclass(w.category, swap.BudgetWarning)]
    assert 1 <= len(found) <= 2, found  # Note [The figure a warning quotes]: once more, higher
    assert all(re.search(r"nothing can be swapped, and the run reaches .* over the budget", w) for w in found), found
    assert found[-1][len("swap: "):] in sm.report()["notes"]  # the note and the warning are one
    # The counts are of one iteration (a micro-batch's forward and backward), not summed over the profiles.
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model(torch.randn(8, 64, 256)).pow(2).mean().backward()
    assert f"per iteration, {len(saved)} saved tensor(s)" in found[0], found[0]


def test_budget_warning_is_a_user_warning_exported_from_swap():
    assert issubclass(swap.BudgetWarning, UserWarning)


def test_saved_tensors_referenced_elsewhere_cannot_be_swapped_and_say_so():
    kept = []
    x = torch.randn(2048, 1024)
    lin = torch.nn.Linear(1024, 1024)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(swap.InfeasibleBudget, match="not swappable"):
            with swap.SwapManager(budget="8MiB", device="cpu", min_bytes=0):
                for _ in range(3):
                    h = lin(x).relu()
                    kept.append(h)  # relu saves h, which the user keeps: swapping it would free nothing
                    h.sum().backward()
    found = [str(w.message) for w in caught if issubclass(w.category, swap.BudgetWarning)]
    assert any("nothing can be swapped" in m and "stay alive elsewhere" in m for m in found), found


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_declines_at_a_budget_equal_to_the_unswapped_peak(name):
    ref = reference(name)
    budget = max(ref["peaks"])  # exactly what the run needs without swapping (before: it swapped anyway)
    got = run(name, 4, meter=swap.LiveBytesMeter("cpu"),
              manager=lambda: swap.SwapManager(budget=budget, device="cpu", min_bytes=16 * KiB))  # fmt: skip
    r = got["manager"].report()
    assert r["declined"] and r["status"] == "declined" and any("fits the budget" in n for n in r["notes"])
    assert r["no_swap_peak_bytes"] == budget
    assert_bitwise_equal(ref, got)
    assert_within(got["peaks"], budget)
    # One byte less and it swaps, within the budget.
    got = run(name, 4, meter=swap.LiveBytesMeter("cpu"),
              manager=lambda: swap.SwapManager(budget=budget - 1, device="cpu", min_bytes=16 * KiB))  # fmt: skip
    assert not got["manager"].report()["declined"]
    assert_within(got["peaks"], budget - 1)


def test_report_before_any_iteration_says_not_started():
    sm = swap.SwapManager(budget="1GiB", device="cpu")
    r = sm.report()
    assert r["status"] == "not started" and not r["declined"] and "not started" in str(r)
    with sm:
        r = sm.report()
        assert r["status"] == "not started" and r["iterations"] == 0 and r["peak_device_bytes"] is None
        x = torch.randn(512, 512, requires_grad=True)
        (x * 2).sigmoid().sum().backward()
        assert sm.report()["status"] == "profiling" and sm.report()["iterations"] == 1


def test_auto_with_nothing_to_move_says_why_it_plans_no_recompute_either():
    # A 12-block MLP-Mixer with AdamW, nothing movable (min_bytes), under strategy "auto": the warning is the
    # note, and the report's recompute line used to say "the run fits, or not planned yet" about a run that
    # does not fit. The joint plan is made on the saved tensors the manager takes; here it takes none.
    meter = swap.LiveBytesMeter("cpu")
    _, model = train_accumulating("mixer", meter=meter, iterations=2, micro=1)
    static = 4 * sum(p.nbytes for p in model.parameters())
    budget = (static + meter.peak) // 2
    del model
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # what a user sees: not only under "always"
        sm, _ = train_accumulating("mixer", manager=lambda: swap.SwapManager(budget=budget, min_bytes="100GiB"),
                                   iterations=3, micro=1)  # fmt: skip
    found = [str(w.message) for w in caught if issubclass(w.category, swap.BudgetWarning)]
    assert len(found) == 1 and "nothing can be swapped" in found[0], found
    r = sm.report()
    assert r["status"] == "declined" and r["policy"] == "auto"
    assert "plans recompute on the saved tensors the manager takes" in r["recompute_plan"], r["recompute_plan"]
    assert "lower min_bytes" in found[0] and "recompute" in found[0]


def test_the_warning_quotes_what_the_run_reaches_once_the_optimizer_has_state():
    # Note [The figure a warning quotes]: judged at the first iteration's end, the warning quoted that
    # iteration's peak; every later one also holds AdamW's moments, and the run reached about half as much again.
    static = 4 * sum(p.nbytes for p in BLOCKS["mixer"]().parameters())  # weights, gradients, AdamW's moments
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager = lambda: swap.SwapManager(budget=static, device="cpu", min_bytes="100GiB")  # noqa: E731
        sm, _ = train_accumulating("mixer", manager=manager, iterations=3, micro=1)
    found = [str(w.message) for w in caught if issubclass(w.category, swap.BudgetWarning)]
    r = sm.report()
    assert "so far" in found[0], found
    assert len(found) == 2 and fmt_bytes(r["peak_device_bytes"]) in found[-1], (found, r["peak_device_bytes"])
    assert found[-1][len("swap: "):] in r["notes"] and found[0][len("swap: "):] not in r["notes"]


def test_a_loop_that_runs_only_under_no_grad_warns_and_the_status_says_why():
    # Note [A manager that saw no training step]: evaluation inside a manager saves nothing for backward, so
    # it never started; it stayed "not started" and said nothing.
    model = BLOCKS["mlp"]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with swap.SwapManager(budget="1MiB", device="cpu") as sm:
            with torch.no_grad():
                for _ in range(3):
                    model(torch.randn(8, 64, 256))
    found = [str(w.message) for w in caught if issubclass(w.category, swap.BudgetWarning)]
    assert len(found) == 1 and "torch.no_grad()" in found[0] and "did not enforce the budget" in found[0], found
    r = sm.report()
    assert r["status"].startswith("not started") and "nothing was saved for backward" in r["status"], r["status"]
    assert found[0][len("swap: "):] in r["notes"] and "nothing was saved for backward" in str(r)
