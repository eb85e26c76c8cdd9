"""The report's over-budget count agrees with the peak it prints (Note [What the over-budget count counts] in
swap.runtime.machine.memory): above zero exactly when the peak is above the budget, declined runs included."""

import gc
import warnings

import torch
from test_no_silent_noop import train_accumulating

import swap


def mixer_budget() -> int:
    """Halfway between the 12-block MLP-Mixer's static bytes (weights, gradients, AdamW's moments) and its
    plain peak, as the independent meter sees it."""
    meter = swap.LiveBytesMeter("cpu")
    _, model = train_accumulating("mixer", meter=meter, iterations=3, micro=1)
    static = 4 * sum(p.nbytes for p in model.parameters())
    budget = (static + meter.peak) // 2
    del model
    gc.collect()
    return budget


def test_a_declined_run_over_the_budget_counts_its_iterations_over_it():
    # Nothing the manager may move (min_bytes above every saved tensor): it declines, warns, and every iteration
    # is over the budget. The report printed that peak beside "steps over budget 0".
    budget = mixer_budget()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", swap.BudgetWarning)
        manager = lambda: swap.SwapManager(budget=budget, device="cpu", min_bytes="100GiB")  # noqa: E731
        sm, _ = train_accumulating("mixer", iterations=4, micro=1, manager=manager)
    r = sm.report()
    assert r["status"] == "declined" and r["peak_device_bytes"] > budget, r
    assert r["overruns"] >= 3, r  # the iterations after the first hold AdamW's state: each is over
    assert f"{r['overruns']:>18}" in str(r).split("steps over budget")[1].split("\n")[0]


def test_a_tensor_outside_training_is_counted_over_the_budget_even_if_a_report_read_its_window():
    budget = mixer_budget()
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", swap.BudgetWarning)
        sm = swap.SwapManager(budget=budget, device="cpu", min_bytes="100GiB")
        with sm:
            model = torch.nn.Linear(256, 256)
            for _ in range(3):
                model(torch.randn(8, 64, 256)).pow(2).mean().backward()
            assert sm.report()["overruns"] == 0  # tiny: within
            big = torch.zeros(budget // 4 + 1)  # a tensor that is not the training's: the CPU budget counts it
            model(torch.randn(8, 64, 256)).pow(2).mean().backward()
            reports.append(sm.report())  # reads (and closes) the window the big tensor is in
            del big
            for _ in range(2):
                model(torch.randn(8, 64, 256)).pow(2).mean().backward()
    r = sm.report()
    assert reports[0]["peak_device_bytes"] > budget and reports[0]["overruns"] >= 1, reports[0]
    assert r["peak_device_bytes"] > budget and r["overruns"] >= 1, r
