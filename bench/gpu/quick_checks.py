"""The checks ``make gpu-quick`` runs (bench/gpu/quick.py runs each in a process of its own).

Most train the swap tests' ResNet (tens of MiB of activations; a few seconds on an H100) under a budget of 60%
of its own unswapped peak. The training checks also run on the CPU with a smaller ResNet (tests/gpu/test_quick.py
runs them there, so their code is exercised without a GPU; their figures only mean something on one).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from bench.gpu.quick import Check, Outcome

MiB = 1 << 20
ITERATIONS = 6  # two profiling iterations, then planned ones
PROFILED_TOLERANCE = 1.25  # profiled compute within this factor of an unhooked step's
REGION_ITERATIONS = 20
MAPS_PER_ITERATION = 100  # about 3 ms of cuMemMap + cuMemSetAccess at the H200's 30 us (vmm_latency.md)
# Note [Steady after the step plan's first service]
# vmalloc settles a repeated step with its step plan (Note [Step plan] in csrc/allocator_plan.cpp), which needs
# three copies of the step to learn it and then maps each of its slots once, the first time it serves them. In
# a swapped run the step repeats from the first planned iteration (the third): the plan is learned by the end
# of the fifth and maps its slots in the sixth. The first lease's check ran 6 iterations and took the last
# three as steady: 11, 0 and 402 maps, the 402 (134 ranges) being the plan's one-time mapping; GPT-2 unswapped
# in bench/gpu/alloc_ratio.py shows the same shape (2756, 688, 319, 331, 6071 maps, then 0 every iteration). So
# this check runs four iterations beyond that one (one spare, for a replan that changes the step once) and
# counts the last three.
VMALLOC_ITERATIONS = ITERATIONS + 4
BANDWIDTH_SHARE = 0.5  # the swap engine's copies reach at least this share of a pinned copy's bandwidth


def device() -> Any:
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def resnet(dev: Any) -> tuple[Any, Any, list[tuple[Any, Any]]]:
    """The swap tests' ResNet (a small one on the CPU), SGD with momentum, and one batch per iteration."""
    import torch

    from swap.forecast import zoo

    layers, width, batch, size = ((2, 2, 2, 2), 32, 32, 96) if dev.type == "cuda" else ((1, 1, 1, 1), 8, 4, 32)
    torch.manual_seed(0)
    model = zoo.resnet(layers, width=width, num_classes=10).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = [zoo.example_batch(model, batch, size, torch.Generator().manual_seed(i), device=dev)
               for i in range(REGION_ITERATIONS)]  # fmt: skip
    return model, opt, batches


def step(model: Any, opt: Any, batch: tuple[Any, Any]) -> None:
    from swap.forecast import zoo

    x, y = batch
    loss = zoo.loss_fn(model, model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def timed(dev: Any, fn: Callable[[], None]) -> float:
    """Seconds ``fn`` takes on the device (CUDA events), or on the host clock on the CPU."""
    import torch

    if dev.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def plain(dev: Any, model: Any, opt: Any, batches: list) -> tuple[int, float]:
    """The unswapped peak and the median step time of three steps after a warm-up, without any hooks."""
    import torch

    import swap

    meter = swap.LiveBytesMeter(dev) if dev.type != "cuda" else None
    if meter is not None:
        meter.track_existing().__enter__()
    else:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()  # this process's own statistics: nobody else reads them
    try:
        step(model, opt, batches[0])
        seconds = [timed(dev, lambda b=b: step(model, opt, b)) for b in batches[1:4]]
    finally:
        if meter is not None:
            meter.__exit__(None, None, None)
    peak = meter.peak if meter is not None else torch.cuda.max_memory_allocated()
    return int(peak), statistics.median(seconds)


def manager(budget: int, **kw: Any) -> Any:
    import swap

    return swap.SwapManager(budget=budget, device=device(), min_bytes="256KiB" if device().type == "cuda" else 0, **kw)


def swapped_run(iterations: int, each: Callable[[Any, int], None] = lambda sm, it: None,
                setup: Callable[[Any], None] = lambda sm: None, **kw: Any) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    """Trains the ResNet unswapped (its peak, its step time), then ``iterations`` under 60% of that peak (1.05x
    the smallest feasible budget where 60% is below it, started over). ``setup(sm)`` runs as each try begins,
    ``each(sm, it)`` after every swapped iteration."""
    import swap

    dev = device()
    model, opt, batches = resnet(dev)
    peak, seconds = plain(dev, model, opt, batches)
    budget = int(0.6 * peak)
    for attempt in range(2):
        sm = manager(budget, **kw)
        try:
            with sm:
                setup(sm)
                for it in range(iterations):
                    step(model, opt, batches[it % len(batches)])
                    each(sm, it)
            break
        except swap.InfeasibleBudget as e:
            if attempt:
                raise
            budget = int(1.05 * e.min_budget)
    return sm, {"budget": budget, "unswapped_peak": peak, "unhooked_step_seconds": seconds}


# -- the checks ---------------------------------------------------------------------------------------------
def adapter() -> Outcome:
    """vmalloc's torch adapter is built and serves as torch's allocator: no plain pluggable allocator."""
    import torch

    import vmalloc
    from vmalloc import torch_adapter

    module = torch_adapter.load()
    if module is None:
        return Outcome(False, f"no adapter: {torch_adapter.reason()}")
    torch.cuda.memory.change_current_allocator(vmalloc.allocator())  # refuses without the adapter
    x = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    stats = torch.cuda.memory_stats()  # torch's plain pluggable allocator raises here
    allocated = stats["allocated_bytes.all.current"]
    ok = vmalloc.installed() and vmalloc.adapter_status()["adapter"] and allocated >= x.numel()
    return Outcome(bool(ok), f"adapter for torch {module.torch_version}: installed {vmalloc.installed()}, "
                   f"torch.cuda.memory_stats() served ({allocated / MiB:.0f} MiB allocated)",
                   {"library": module.__file__})  # fmt: skip


def pytest_outcome(args: list[str], expect: int, what: str) -> Outcome:
    """Runs pytest here on ``args``: a PASS when at least ``expect`` tests ran and passed, and none failed."""
    import pytest

    class Tally:
        def __init__(self) -> None:
            self.passed = self.failed = self.skipped = 0
            self.first = ""

        def pytest_runtest_logreport(self, report: Any) -> None:
            if report.passed and report.when == "call":
                self.passed += 1
            elif report.failed:
                self.failed += 1
                lines = report.longreprtext.strip().splitlines()
                self.first = self.first or f"{report.nodeid.split('::')[-1]}: {lines[-1][:200] if lines else ''}"
            elif report.skipped:
                self.skipped += 1

    tally = Tally()
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "-rs", *args], plugins=[tally])
    ok = rc == 0 and tally.failed == 0 and tally.passed >= expect
    figure = f"{tally.passed} of {expect} {what}"
    if tally.failed or tally.skipped:
        figure += f"; {tally.failed} failed, {tally.skipped} skipped" + (f" ({tally.first})" if tally.first else "")
    return Outcome(ok, figure, {"passed": tally.passed, "failed": tally.failed, "skipped": tally.skipped})


def rebuilds() -> Outcome:
    """Batch norm rebuilds are bitwise on cuDNN and on the native kernels."""
    return pytest_outcome(["tests/gpu/test_rebuild_cuda.py"], 6, "batch norm rebuilds bitwise (cuDNN and native)")


def resnet_vmalloc_swap() -> Outcome:
    """The ResNet swapped with vmalloc as torch's allocator: bitwise, within the budget, by an oracle too."""
    node = "tests/gpu/test_swap_cuda.py::test_swapped_gradients_are_bitwise_equal_and_within_budget[vmalloc-resnet]"
    return pytest_outcome([node], 1, "resnet runs swapped on vmalloc, bitwise and within the budget")


def host_waits() -> Outcome:
    """No host waits on copies in planned iterations (Note [Device-side waits] in swap/runtime/machine/engines.py)."""
    per: list[tuple[str, int]] = []
    last = [0]

    def setup(sm: Any) -> None:
        per.clear()
        last[0] = 0

    def each(sm: Any, it: int) -> None:
        waits = sm.executor.engine.host_waits
        per.append((sm.executor.mode, waits - last[0]))
        last[0] = waits

    sm, data = swapped_run(ITERATIONS, each, setup, policy="window")
    planned = [n for mode, n in per if mode == "planned"]
    stall = sm.report()["stall_seconds"]
    ok = bool(planned) and not any(planned)
    return Outcome(ok, f"host waits per planned iteration {planned} (all iterations: {[n for _, n in per]}), "
                   f"stall {stall:.4f} s", {**data, "per_iteration": per, "stall_seconds": stall})  # fmt: skip


def _swap_only(ev: Any) -> Any:
    from swap.joint.search import BASELINES, JointResult

    return JointResult(BASELINES["window"](ev), {}, ev.evaluations)


def _plan_of(sm: Any) -> str:
    """What the joint search decided, as the report says it (why nothing was recomputed, where nothing was)."""
    return str(sm.report().get("recompute_plan"))


def profiled_time() -> Outcome:
    """The step time the planner profiles against an unhooked step's (the default strategy, its operator profiler
    on; Note [Our own time is not the model's] in swap/runtime/machine/timers.py).

    The joint search is held to swapping only: a recompute plan would profile once more with checkpointed
    modules whose reruns are compute an unhooked step does not do, and the ratio would then measure the plan, not
    the profiler. The profiled iterations still run the operator profiler, whose own time is what must not show.
    """

    def setup(sm: Any) -> None:
        sm._joint.choose = _swap_only

    sm, data = swapped_run(3, setup=setup)
    seq = sm.sequence
    if seq is None:
        return Outcome(False, f"nothing was profiled ({_plan_of(sm)})", data)
    first_use = next((i for i, k in enumerate(seq.kind) if k == "use"), len(seq))
    forward, backward = sum(seq.compute[:first_use]), sum(seq.compute[first_use:])
    profiled, unhooked = forward + backward, data["unhooked_step_seconds"]
    ratio = profiled / unhooked
    ok = 1 / PROFILED_TOLERANCE <= ratio <= PROFILED_TOLERANCE
    return Outcome(ok, f"profiled {profiled * 1e3:.2f} ms ({forward * 1e3:.2f} forward, {backward * 1e3:.2f} from the "
                   f"first backward use on) against {unhooked * 1e3:.2f} ms unhooked: {ratio:.2f}x (within "
                   f"{PROFILED_TOLERANCE}x passes)",
                   {**data, "profiled_seconds": profiled, "forward_seconds": forward, "backward_seconds": backward,
                    "steps": len(seq), "ratio": ratio, "recompute_plan": _plan_of(sm)})  # fmt: skip


def _checkpoint_everything(ev: Any) -> Any:
    """Every block of a level checkpointed, what is still saved swapped by the window: the fastest level that
    fits the budget (``checkpoint_window``), else full checkpointing without swapping where that fits. Taking
    "checkpoint"'s level and judging it with the window instead (as this did) could pick a level that fits
    neither way, and then no region ran at all (0 regions on the 2026-11-28 H200 lease)."""
    from swap.joint.search import JointResult, checkpoint, checkpoint_window

    best = checkpoint_window(ev)
    if not best.feasible:
        best = checkpoint(ev)
    return JointResult(best, {}, ev.evaluations)


def region_events() -> Outcome:
    """Timer marks (two CUDA events each) kept by recompute regions after 20 iterations (Note [Rerun timing]).
    A run in which no region reran proves nothing about the marks: it fails, saying what the search decided."""

    def setup(sm: Any) -> None:
        sm._joint.choose = _checkpoint_everything  # regions for certain, whatever the search would choose

    sm, data = swapped_run(REGION_ITERATIONS, setup=setup)
    stats = list(sm.joint_view.regions.values())
    marks, reruns = sum(len(s.rerun_marks) for s in stats), sum(s.reruns for s in stats)
    data = {**data, "marks": marks, "regions": len(stats), "reruns": reruns, "recompute_plan": _plan_of(sm)}
    if not reruns:
        return Outcome(False, f"no region reran in {REGION_ITERATIONS} iterations, so no mark was made: "
                       f"{len(stats)} regions; recompute plan: {data['recompute_plan']}", data)  # fmt: skip
    ok = marks <= 2 * len(stats)
    return Outcome(ok, f"{marks} marks ({2 * marks} events) alive after {REGION_ITERATIONS} iterations: {len(stats)} "
                   f"regions, {reruns} reruns (passes: at most 2 marks a region)", data)  # fmt: skip


def vmalloc_calls() -> Outcome:
    """vmalloc's maps and host event waits per steady iteration, swapping, vmalloc as torch's allocator."""
    import torch

    import vmalloc

    torch.cuda.memory.change_current_allocator(vmalloc.allocator())
    keys = ("num_maps", "num_unmaps", "num_set_access", "num_event_syncs")
    seen: list[dict[str, int]] = []

    def each(sm: Any, it: int) -> None:
        s = vmalloc.stats(0)
        seen.append({k: s[k] for k in keys})

    swapped_run(VMALLOC_ITERATIONS, each, lambda sm: seen.clear(), policy="window")
    per = [{k: b[k] - a[k] for k in keys} for a, b in zip(seen, seen[1:])]  # iterations 1 on
    steady = per[-3:]  # Note [Steady after the step plan's first service]
    maps = max(d["num_maps"] for d in steady)
    syncs = max(d["num_event_syncs"] for d in steady)
    s = vmalloc.stats(0)
    plans = {k: s[k] for k in ("num_plans", "num_plans_abandoned", "num_plan_hits", "num_plan_misses")}
    ok = syncs == 0 and maps <= MAPS_PER_ITERATION
    return Outcome(ok, f"per steady iteration (the last 3 of {VMALLOC_ITERATIONS}): {maps} maps, "
                   f"{max(d['num_unmaps'] for d in steady)} unmaps, {syncs} host event waits (passes: 0 waits, at "
                   f"most {MAPS_PER_ITERATION} maps); maps per iteration {[d['num_maps'] for d in per]}, "
                   f"{plans['num_plans']} step plan(s)", {"steady": steady, "per_iteration": per, **plans})


def copy_bandwidth() -> Outcome:
    """The swap engine's copy bandwidth against a pinned copy's on this machine."""
    from bench.gpu.pinned_bandwidth import measure

    sm, data = swapped_run(ITERATIONS, policy="window")
    engine = sm.executor.engine
    achieved = {"d2h": engine.d2h_bw.rate(0.0) / 1e9, "h2d": engine.h2d_bw.rate(0.0) / 1e9}
    peak = measure(256 * MiB, 3)
    share = {k: achieved[k] / peak[k] for k in achieved}
    ok = all(s >= BANDWIDTH_SHARE for s in share.values())
    figure = ", ".join(f"{k.upper()} {achieved[k]:.1f} of {peak[k]:.1f} GB/s ({share[k]:.0%})" for k in achieved)
    return Outcome(ok, f"{figure} (passes at {BANDWIDTH_SHARE:.0%})",
                   {**data, "achieved_gbps": achieved, "pinned_gbps": peak})  # fmt: skip


CHECKS = [
    Check("adapter", "vmalloc's torch adapter is built and installed (no fallback)", 180, adapter),
    Check("rebuilds", "batch norm rebuilds bitwise on cuDNN and native", 90, rebuilds),
    Check("resnet_vmalloc_swap", "ResNet swapped on vmalloc: bitwise, within budget, oracle", 120, resnet_vmalloc_swap),
    Check("host_waits", "host waits per planned iteration (0)", 60, host_waits),
    Check("profiled_time", "profiled step time against an unhooked step", 60, profiled_time),
    Check("region_events", "recompute-region timer events alive after 20 iterations", 90, region_events),
    Check("vmalloc_calls", "vmalloc maps and event waits per steady iteration", 60, vmalloc_calls),
    Check("copy_bandwidth", "swap copy bandwidth against pinned peak", 60, copy_bandwidth),
]
