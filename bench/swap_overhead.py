"""What the swap runtime costs on CPU: the meter, the hooks, and a planned iteration against plain training.

    python -m bench.swap_overhead            # two models, 5 rounds each (a few minutes on 2 cores)
    python -m bench.swap_overhead --quick    # a smoke run

For each model (a GPT-2-style transformer and a residual CNN, both from bench.models), every round builds the
model afresh and times training iterations (forward, backward, SGD step) under:

- ``plain``: no manager, no meter;
- ``null mode``: an empty TorchDispatchMode, the floor of any dispatch-mode meter;
- ``meter``: swap.LiveBytesMeter alone (how the CPU runtime measures the budget);
- ``declined``: a SwapManager whose budget the run fits (it profiles, then steps aside);
- ``planned``: a SwapManager at a budget a third of the way from the smallest feasible one (``min_budget``)
  to the unswapped peak, after its profiling iterations.

Timed iterations are the ones after the manager has planned (or declined). The hooks' own cost is timed
inside them: per pack/unpack call, on the meter path (the CPU runtime as shipped) and with the meter
replaced by a memory source that measures nothing (what the hooks cost by themselves; a GPU run reads the
allocator instead of a meter). The figures are min and median over the rounds. Copies run on two worker
threads that compete with the compute thread for this machine's cores, so planned iterations include real
copy time, not only bookkeeping.

Writes <out>/swap_overhead.json and swap_overhead.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import swap
import swap.manager
from bench import models
from swap.memory import DeviceMemory

ROOT = Path(__file__).resolve().parents[1]

MODELS: dict[str, Callable[[], tuple[torch.nn.Module, int, int]]] = {
    "gpt (4 layers, d=256, seq 128, batch 8)": lambda: (
        models.gpt(n_layer=4, n_head=4, d_model=256, vocab=1000, seq_len=128), 8, 128),
    "resnet (bottleneck 1-1-1-1, width 16, 64x64, batch 16)": lambda: (
        models.resnet((1, 1, 1, 1), width=16, num_classes=10), 16, 64),
}  # fmt: skip


class NullMode(TorchDispatchMode):
    """A dispatch mode that does nothing: what any Python-level meter costs at least."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        return func(*args, **kwargs) if kwargs else func(*args)


class NullMemory(DeviceMemory):
    """Measures nothing: the hooks' own cost, without the CPU meter behind them."""

    name = "none (benchmark)"

    def _window_peak(self) -> int:
        return 0

    def window_peak(self) -> int:
        return 0

    def current(self) -> int:
        return 0

    def __init__(self, device: Any = None) -> None:
        super().__init__()


class HookTimer:
    """Times SwapManager's pack and unpack hooks (class-level wrappers, removed by ``close``)."""

    def __init__(self) -> None:
        self.calls = {"pack": 0, "unpack": 0}
        self.seconds = {"pack": 0.0, "unpack": 0.0}
        self.on = False
        self._orig = (swap.manager.SwapManager._pack, swap.manager.SwapManager._unpack)
        timer = self

        def wrap(name: str, fn: Callable) -> Callable:
            def timed(sm: Any, x: Any) -> Any:
                if not timer.on:
                    return fn(sm, x)
                t0 = time.perf_counter()
                try:
                    return fn(sm, x)
                finally:
                    timer.seconds[name] += time.perf_counter() - t0
                    timer.calls[name] += 1

            return timed

        swap.manager.SwapManager._pack = wrap("pack", self._orig[0])
        swap.manager.SwapManager._unpack = wrap("unpack", self._orig[1])

    def close(self) -> None:
        swap.manager.SwapManager._pack, swap.manager.SwapManager._unpack = self._orig

    def per_call_us(self, name: str) -> Optional[float]:
        return self.seconds[name] / self.calls[name] * 1e6 if self.calls[name] else None


def train(build: Callable, context: Optional[Callable[[], Any]], warmup: int, timed: int,
          timer: Optional[HookTimer] = None) -> tuple[list[float], Any]:  # fmt: skip
    """Seconds per timed iteration (after ``warmup`` iterations), and the context object."""
    torch.manual_seed(0)
    model, batch, size = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = models.example_batch(model, batch, size, torch.Generator().manual_seed(0))
    ctx = context() if context else None
    times = []
    if ctx is not None:
        ctx.__enter__()
    try:
        for it in range(warmup + timed):
            if timer is not None:
                timer.on = it >= warmup
            t0 = time.perf_counter()
            loss = models.loss_fn(model, model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if it >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        if timer is not None:
            timer.on = False
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return times, ctx


def unswapped_peak(build: Callable) -> int:
    meter = swap.LiveBytesMeter("cpu").track_existing()
    train(build, lambda: meter, 0, 2)
    return meter.peak


def smallest_budget(build: Callable) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the profiling iterations' BudgetWarning: expected at 64 KiB
        try:
            train(build, lambda: swap.SwapManager(budget="64KiB", device="cpu", min_bytes="16KiB"), 3, 0)
        except swap.InfeasibleBudget as e:
            return getattr(e, "min_budget", e.needed)
    raise AssertionError("a 64 KiB budget fitted")


def measure(name: str, build: Callable, rounds: int, warmup: int, timed: int,
            budget: Optional[int] = None) -> dict[str, Any]:  # fmt: skip
    peak = unswapped_peak(build)
    floor = smallest_budget(build)
    budget = budget or floor + (peak - floor) // 3
    runs: dict[str, list[float]] = {k: [] for k in ("plain", "null mode", "meter", "declined", "planned",
                                                    "planned, no meter")}  # fmt: skip
    hooks: dict[str, list[float]] = {k: [] for k in ("pack", "unpack", "pack, no meter", "unpack, no meter")}
    facts: dict[str, Any] = {}
    for r in range(rounds):
        print(f"  {name}: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
        runs["plain"].append(statistics.mean(train(build, None, warmup, timed)[0]))
        runs["null mode"].append(statistics.mean(train(build, NullMode, warmup, timed)[0]))
        runs["meter"].append(statistics.mean(
            train(build, lambda: swap.LiveBytesMeter("cpu").track_existing(), warmup, timed)[0]))  # fmt: skip
        manager = lambda b: lambda: swap.SwapManager(budget=b, device="cpu", min_bytes="16KiB")  # noqa: E731
        times, sm = train(build, manager(64 << 30), warmup, timed)
        runs["declined"].append(statistics.mean(times))
        facts["declined_status"] = sm.report().get("status", sm.report()["declined"])
        timer = HookTimer()
        try:
            times, sm = train(build, manager(budget), warmup, timed, timer)
        finally:
            timer.close()
        runs["planned"].append(statistics.mean(times))
        report = sm.report()
        facts.update(planned_status=report.get("status"), steps=timer.calls["pack"] + timer.calls["unpack"],
                     swapped_out_per_iteration=report["swapped_out_bytes"] // max(report["iterations"], 1),
                     budget=budget, unswapped_peak=peak, min_budget=floor, replans=report["replans"])  # fmt: skip
        hooks["pack"].append(timer.per_call_us("pack"))
        hooks["unpack"].append(timer.per_call_us("unpack"))
        # The hooks without the meter, with a memory source that measures nothing: the plan then sees only
        # the saved tensors, so its budget is half of what they reach at once (it must swap to keep it).
        live = max(sm.sequence.live_bytes()) if sm.sequence is not None else 0
        real = swap.manager.MeterMemory
        swap.manager.MeterMemory = NullMemory
        timer = HookTimer()
        try:
            times, sm = train(build, manager(max(live // 2, max(sm.sequence.sizes))), warmup, timed, timer)
        finally:
            timer.close()
            swap.manager.MeterMemory = real
        facts["no_meter_status"] = sm.report().get("status")
        runs["planned, no meter"].append(statistics.mean(times))
        hooks["pack, no meter"].append(timer.per_call_us("pack"))
        hooks["unpack, no meter"].append(timer.per_call_us("unpack"))
    plain = min(runs["plain"])
    summary = {
        k: {"min_ms": min(v) * 1e3, "median_ms": statistics.median(v) * 1e3, "min_over_plain": min(v) / plain,
            "median_over_plain": statistics.median(v) / statistics.median(runs["plain"])}
        for k, v in runs.items()
    }  # fmt: skip
    hook_summary = {
        k: {"min_us": min(x for x in v if x is not None), "median_us": statistics.median(x for x in v if x is not None)}
        for k, v in hooks.items() if any(x is not None for x in v)
    }  # fmt: skip
    return {"iterations": summary, "hooks": hook_summary, "facts": facts, "rounds": rounds, "timed": timed}


def comparison(results: dict[str, Any], baseline: dict[str, Any], label: str) -> list[str]:
    """Lines comparing ``results`` with an earlier run of the same budgets (``--baseline``)."""
    lines = [f"## Against {label}", "",
             "Same models, budgets and rounds, run back to back on the same machine (min over rounds).", "",
             "| model | run / hook | before | after |", "|---|---|---:|---:|"]  # fmt: skip
    for name, r in results.items():
        b = baseline["results"].get(name)
        if b is None:
            continue
        short = name.split(" (")[0]
        for k in ("meter", "declined", "planned", "planned, no meter"):
            lines.append(f"| {short} | {k} (x plain) | {b['iterations'][k]['min_over_plain']:.3f} | "
                         f"{r['iterations'][k]['min_over_plain']:.3f} |")  # fmt: skip
        for k in r["hooks"]:
            if k in b["hooks"]:
                lines.append(f"| {short} | {k} (µs per call) | {b['hooks'][k]['min_us']:.1f} | "
                             f"{r['hooks'][k]['min_us']:.1f} |")  # fmt: skip
    return lines + [""]


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        "# Swap runtime overhead on CPU",
        "",
        f"`python -m bench.swap_overhead` on {meta['machine']}, torch {meta['torch']}, {meta['threads']} "
        f"compute thread(s); {meta['rounds']} rounds, {meta['timed']} timed iterations each (after the "
        "manager planned or declined). Seconds per iteration (forward, backward, SGD step); ratios against "
        "`plain`. Planned runs use a budget a third of the way from `min_budget` to the unswapped peak.",
        "",
    ]
    for name, r in results.items():
        f = r["facts"]
        lines += [
            f"## {name}",
            "",
            f"unswapped peak {f['unswapped_peak'] / 2**20:.1f} MiB, budget {f['budget'] / 2**20:.1f} MiB, "
            f"{f['steps'] // max(r['timed'], 1)} hook calls and {f['swapped_out_per_iteration'] / 2**20:.1f} MiB "
            f"swapped out per iteration; status after profiling: {f.get('planned_status')} "
            f"(declined run: {f.get('declined_status')}; run without meter: {f.get('no_meter_status')}), "
            f"re-plans {f['replans']}.",
            "",
            "| run | min ms | median ms | min / plain | median / plain |",
            "|---|---:|---:|---:|---:|",
        ]
        for k, s in r["iterations"].items():
            lines.append(f"| {k} | {s['min_ms']:.1f} | {s['median_ms']:.1f} | {s['min_over_plain']:.3f} | "
                         f"{s['median_over_plain']:.3f} |")  # fmt: skip
        lines += ["", "| hook | min µs per call | median µs per call |", "|---|---:|---:|"]
        for k, s in r["hooks"].items():
            lines.append(f"| {k} | {s['min_us']:.1f} | {s['median_us']:.1f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.swap_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="one small round per model (a smoke run)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch compute threads (1: steadier timings)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--budgets-from", type=Path, default=None,
                    help="an earlier swap_overhead.json whose budgets to use (to compare two versions)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a swap_overhead.json of another version, run with the same budgets: adds a comparison")
    ap.add_argument("--baseline-label", default="the baseline")
    args = ap.parse_args(argv)
    budgets = {}
    if args.budgets_from:
        budgets = {k: v["facts"]["budget"] for k, v in json.loads(args.budgets_from.read_text())["results"].items()}
    torch.set_num_threads(args.threads)
    rounds, warmup, timed = (1, 3, 2) if args.quick else (args.rounds, 3, 3)
    results = {name: measure(name, build, rounds, warmup, timed, budgets.get(name)) for name, build in MODELS.items()}
    meta = {"machine": f"{platform.machine()} {platform.processor() or ''} ({torch.get_num_threads()} threads)".strip(),
            "torch": torch.__version__, "threads": args.threads, "rounds": rounds, "timed": timed,
            "python": platform.python_version()}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "swap_overhead.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    text = markdown(results, meta)
    if args.baseline:
        baseline = json.loads(args.baseline.read_text())
        text += "\n" + "\n".join(comparison(results, baseline, args.baseline_label))
        meta["baseline"] = {"label": args.baseline_label, "meta": baseline["meta"]}
        (args.out / "swap_overhead.json").write_text(
            json.dumps({"meta": meta, "results": results, "baseline": baseline["results"]}, indent=1) + "\n")
    (args.out / "swap_overhead.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
