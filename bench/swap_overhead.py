"""What the swap runtime costs on CPU: the meter, the hooks, and a planned iteration against plain training.

    python -m bench.swap_overhead            # two models, 5 rounds each (a few minutes on 2 cores)
    python -m bench.swap_overhead --quick    # a smoke run

For each model (a GPT-2-style transformer and a residual CNN, both from swap.forecast.zoo), every round builds the
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
allocator instead of a meter). A round's figure is its fastest timed iteration; the tables give the min and
the median of those over the rounds.

Note [CPU time, not wall time]
This project's machine is shared (2 cores, several builds and test runs at once), so wall times swing by
2x from one minute to the next. Iterations are therefore measured in CPU time of the process
(``time.process_time``: the compute thread plus the copy workers, whose memcpy is real work) and the hooks
in CPU time of the calling thread (``time.thread_time``: a hook blocked on a copy does not count; the
report's ``stall_seconds`` is that wait). Wall-clock medians are listed alongside.

Writes <out>/swap_overhead.json and swap_overhead.md.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
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
import swap.runtime.manager
from swap.forecast import zoo as models

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


def null_memory(lib: Any) -> type:
    """A memory source of ``lib`` (a swap package) that measures nothing: the hooks' own cost, without the
    CPU meter behind them."""

    def nothing(self: Any, *args: Any) -> int:
        return 0

    def init(self: Any, device: Any = None) -> None:
        lib.runtime.memory.DeviceMemory.__init__(self)

    return type("NullMemory", (lib.runtime.memory.DeviceMemory,), {
        "name": "none (benchmark)", "__init__": init, "_window_peak": nothing, "window_peak": nothing,
        "current": nothing})  # fmt: skip


class HookTimer:
    """Times the saved-tensor hooks' pack and unpack of ``lib`` (a swap package; class-level wrappers, removed
    by ``close``): ``SavedTensorHooks`` (swap.runtime.activations.hooks), or in versions before it the manager's own
    ``_pack`` and ``_unpack`` (so that ``--before`` can load one)."""

    def __init__(self, lib: Any) -> None:
        hooks = getattr(lib.runtime, "hooks", None)
        if hooks is not None:
            self.cls, self.names = hooks.SavedTensorHooks, ("pack", "unpack")
        else:
            self.cls, self.names = lib.runtime.manager.SwapManager, ("_pack", "_unpack")
        self.calls = {"pack": 0, "unpack": 0}
        self.seconds = {"pack": 0.0, "unpack": 0.0}
        self.on = False
        self._orig = tuple(getattr(self.cls, name) for name in self.names)
        timer = self

        def wrap(name: str, fn: Callable) -> Callable:
            def timed(sm: Any, x: Any) -> Any:
                if not timer.on:
                    return fn(sm, x)
                t0 = time.thread_time()
                try:
                    return fn(sm, x)
                finally:
                    timer.seconds[name] += time.thread_time() - t0
                    timer.calls[name] += 1

            return timed

        for key, name, fn in zip(("pack", "unpack"), self.names, self._orig):
            setattr(self.cls, name, wrap(key, fn))

    def close(self) -> None:
        for name, fn in zip(self.names, self._orig):
            setattr(self.cls, name, fn)

    def per_call_us(self, name: str) -> Optional[float]:
        return self.seconds[name] / self.calls[name] * 1e6 if self.calls[name] else None


def load_version(path: Path) -> Any:
    """The ``swap`` package of another checkout (e.g. ``git archive <commit>`` unpacked at ``path``), imported
    as ``swap_ab`` beside this one, so that both versions run interleaved in one process."""
    spec = importlib.util.spec_from_file_location("swap_ab", path / "swap" / "__init__.py",
                                                  submodule_search_locations=[str(path / "swap")])  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    sys.modules["swap_ab"] = module
    spec.loader.exec_module(module)
    importlib.import_module("swap_ab.runtime.manager")
    importlib.import_module("swap_ab.runtime.memory")
    return module


class Timed(list):
    """CPU seconds per timed iteration (Note [CPU time, not wall time]); ``wall``: the same iterations'
    wall-clock seconds."""

    wall: list[float]


def train(build: Callable, context: Optional[Callable[[], Any]], warmup: int, timed: int,
          timer: Optional[HookTimer] = None) -> tuple[Timed, Any]:  # fmt: skip
    """The timed iterations (after ``warmup`` iterations), and the context object."""
    torch.manual_seed(0)
    model, batch, size = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = models.example_batch(model, batch, size, torch.Generator().manual_seed(0))
    ctx = context() if context else None
    times, wall = Timed(), []
    if ctx is not None:
        ctx.__enter__()
    try:
        for it in range(warmup + timed):
            if timer is not None:
                timer.on = it >= warmup
            c0, t0 = time.process_time(), time.perf_counter()
            loss = models.loss_fn(model, model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if it >= warmup:
                times.append(time.process_time() - c0)
                wall.append(time.perf_counter() - t0)
    finally:
        if timer is not None:
            timer.on = False
        if ctx is not None:
            ctx.__exit__(None, None, None)
    times.wall = wall
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


def record(runs: dict[str, list[tuple[float, float]]], key: str, times: Timed) -> None:
    """A round's figure: its fastest timed iteration (a neighbour's burst on the shared machine only ever adds
    time), and the median wall time."""
    runs.setdefault(key, []).append((min(times), statistics.median(times.wall)))


def manager_runs(lib: Any, build: Callable, budget: int, warmup: int, timed: int,
                 runs: dict[str, list[float]], hooks: dict[str, list[Optional[float]]], facts: dict[str, Any],
                 prefix: str = "") -> None:  # fmt: skip
    """One round of ``lib``'s meter, declined, planned and planned-without-meter runs, appended under ``prefix``."""
    record(runs, prefix + "meter", train(build, lambda: lib.LiveBytesMeter("cpu").track_existing(), warmup, timed)[0])

    def manager(b: int) -> Callable:
        return lambda: lib.SwapManager(budget=b, device="cpu", min_bytes="16KiB")

    times, sm = train(build, manager(64 << 30), warmup, timed)
    record(runs, prefix + "declined", times)
    facts[prefix + "declined_status"] = sm.report().get("status", sm.report()["declined"])
    timer = HookTimer(lib)
    try:
        times, sm = train(build, manager(budget), warmup, timed, timer)
    finally:
        timer.close()
    record(runs, prefix + "planned", times)
    report = sm.report()
    per_iteration = report["swapped_out_bytes"] // max(report["iterations"], 1)
    facts.update({prefix + "planned_status": report.get("status"), prefix + "replans": report["replans"],
                  prefix + "steps": timer.calls["pack"] + timer.calls["unpack"],
                  prefix + "swapped_out_per_iteration": per_iteration})  # fmt: skip
    hooks.setdefault(prefix + "pack", []).append(timer.per_call_us("pack"))
    hooks.setdefault(prefix + "unpack", []).append(timer.per_call_us("unpack"))
    # The hooks without the meter, with a memory source that measures nothing: the plan then sees only the
    # saved tensors, so its budget is half of what they reach at once (it must swap to keep it).
    seq = sm.sequence
    no_meter_budget = max(max(seq.live_bytes()) // 2, max(seq.sizes))
    opens = getattr(lib.runtime, "resources", lib.runtime.manager)  # where the manager's memory source is made
    real = opens.MeterMemory
    opens.MeterMemory = null_memory(lib)
    timer = HookTimer(lib)
    try:
        times, sm = train(build, manager(no_meter_budget), warmup, timed, timer)
    finally:
        timer.close()
        opens.MeterMemory = real
    facts[prefix + "no_meter_status"] = sm.report().get("status")
    record(runs, prefix + "planned, no meter", times)
    hooks.setdefault(prefix + "pack, no meter", []).append(timer.per_call_us("pack"))
    hooks.setdefault(prefix + "unpack, no meter", []).append(timer.per_call_us("unpack"))


def measure(name: str, build: Callable, rounds: int, warmup: int, timed: int,
            other: Optional[Any] = None) -> dict[str, Any]:  # fmt: skip
    peak = unswapped_peak(build)
    floor = smallest_budget(build)
    budget = floor + (peak - floor) // 3
    runs: dict[str, list[tuple[float, float]]] = {}
    hooks: dict[str, list[Optional[float]]] = {}
    facts: dict[str, Any] = {"budget": budget, "unswapped_peak": peak, "min_budget": floor}
    for r in range(rounds):
        print(f"  {name}: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
        record(runs, "plain", train(build, None, warmup, timed)[0])
        record(runs, "null mode", train(build, NullMode, warmup, timed)[0])
        manager_runs(swap, build, budget, warmup, timed, runs, hooks, facts)
        if other is not None:  # the other version, in the same round (interleaved: same machine load)
            manager_runs(other, build, budget, warmup, timed, runs, hooks, facts, prefix="before: ")
    plain = [c for c, _ in runs["plain"]]
    summary = {}
    for k, v in runs.items():
        cpu, wall = [c for c, _ in v], [w for _, w in v]
        summary[k] = {"min_ms": min(cpu) * 1e3, "median_ms": statistics.median(cpu) * 1e3,
                      "min_over_plain": min(cpu) / min(plain),
                      "median_over_plain": statistics.median(cpu) / statistics.median(plain),
                      "median_wall_ms": statistics.median(wall) * 1e3}  # fmt: skip
    hook_summary = {}
    for k, v in hooks.items():
        values = [x for x in v if x is not None]
        if values:
            hook_summary[k] = {"min_us": min(values), "median_us": statistics.median(values)}
    return {"iterations": summary, "hooks": hook_summary, "facts": facts, "rounds": rounds, "timed": timed}


def comparison(results: dict[str, Any], label: str) -> list[str]:
    """Before/after lines, from runs of both versions interleaved in the same rounds (``--before``)."""
    lines = [f"## Against {label}", "",
             "Both versions ran in the same process, interleaved round by round (same machine load), with the "
             "same budgets. Ratios are against the same `plain` runs.", "",
             "| model | run / hook | before min | after min | before median | after median |",
             "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for name, r in results.items():
        short = name.split(" (")[0]
        for k in ("meter", "declined", "planned", "planned, no meter"):
            b, a = r["iterations"].get("before: " + k), r["iterations"][k]
            if b:
                lines.append(f"| {short} | {k} (x plain) | {b['min_over_plain']:.3f} | {a['min_over_plain']:.3f} | "
                             f"{b['median_over_plain']:.3f} | {a['median_over_plain']:.3f} |")  # fmt: skip
        for k in ("pack", "unpack", "pack, no meter", "unpack, no meter"):
            b, a = r["hooks"].get("before: " + k), r["hooks"].get(k)
            if b and a:
                lines.append(f"| {short} | {k} (µs per call) | {b['min_us']:.1f} | {a['min_us']:.1f} | "
                             f"{b['median_us']:.1f} | {a['median_us']:.1f} |")  # fmt: skip
    return lines + [""]


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        "# Swap runtime overhead on CPU",
        "",
        f"`python -m bench.swap_overhead` on {meta['machine']}, torch {meta['torch']}, {meta['threads']} "
        f"compute thread(s); {meta['rounds']} rounds, {meta['timed']} timed iterations each (after the "
        "manager planned or declined; a round counts its fastest). CPU milliseconds of the process per "
        "iteration (forward, backward, SGD "
        "step; the copy threads included), ratios against `plain`, and the wall-clock median (the machine is "
        "shared: see the Note in bench/swap_overhead.py). Hooks: CPU µs of the calling thread per call. "
        "Planned runs use a budget a third of the way from `min_budget` to the unswapped peak.",
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
            "| run | min CPU ms | median CPU ms | min / plain | median / plain | median wall ms |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for k, s in r["iterations"].items():
            if k.startswith("before: "):
                continue
            lines.append(f"| {k} | {s['min_ms']:.1f} | {s['median_ms']:.1f} | {s['min_over_plain']:.3f} | "
                         f"{s['median_over_plain']:.3f} | {s['median_wall_ms']:.1f} |")  # fmt: skip
        lines += ["", "| hook | min CPU µs per call | median CPU µs per call |", "|---|---:|---:|"]
        for k, s in r["hooks"].items():
            if k.startswith("before: "):
                continue
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
    ap.add_argument("--before", type=Path, default=None,
                    help="a checkout of an earlier version (its swap/ package is loaded beside this one): both "
                         "run interleaved, and a before/after table is added")
    ap.add_argument("--before-label", default="the earlier version")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds, warmup, timed = (1, 3, 2) if args.quick else (args.rounds, 3, 5)
    other = load_version(args.before) if args.before else None
    results = {name: measure(name, build, rounds, warmup, timed, other) for name, build in MODELS.items()}
    meta = {"machine": f"{platform.machine()} {platform.processor() or ''} ({torch.get_num_threads()} threads)".strip(),
            "torch": torch.__version__, "threads": args.threads, "rounds": rounds, "timed": timed,
            "python": platform.python_version()}  # fmt: skip
    if other is not None:
        meta["before"] = args.before_label
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "swap_overhead.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    text = markdown(results, meta)
    if other is not None:
        text += "\n" + "\n".join(comparison(results, args.before_label))
    (args.out / "swap_overhead.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
