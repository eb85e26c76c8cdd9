"""What vmalloc costs per steady training iteration: driver calls, host waits and memory, by policy.

    python -m bench.steady_state            # the traces below (~3 minutes with captures)
    python -m bench.steady_state --quick    # two small traces
    python -m bench.steady_state --legacy   # default options only, to run against an older vmalloc build
                                            # (PYTHONPATH=<its vmalloc>:<this repo>): steady_state_legacy.md

The first GPU run trained slower on vmalloc than on torch's allocator with no swapping at all (H200: GPT-2
batch 4 at 80.0k against 113.8k tokens/s, ResNet-50 batch 96 at 1928 against 2062 images/s,
bench/results/gpu/NVIDIA_H200/training.md). A steady iteration should cost an allocator nothing but its
bookkeeping: no cuMemMap / cuMemUnmap / cuMemSetAccess (3, 20 and 30 us each on the H200, vmm_latency.md) and
no host wait, which stops the CPU running ahead of the GPU. This replays captured training steps (bench.traces,
12 steps; a repeated step is what training is) through vmalloc's core with the test backend, which plays a GPU
whose work of an iteration completes only when the iteration ends (the training loop's synchronize), so every
wait inside an iteration is a host wait, and counts per iteration, averaged over the last three:
maps, unmaps, set_access, event records, event queries, capture queries, host waits (num_event_syncs).
Policies (arena options): the default (the step plan, Note [Step plan], over reclaim first: growth_slack=0),
reclaim first without the plan (step_plan=False), the growth slack without the plan (growth_slack=0.125, the
default before the step plan), and the default with mid-size slabs (mid_chunks=4, opt-in: Note [Mid-size
blocks]). Memory: peak requested / allocated / reserved; efficiency = requested / reserved; utilization =
allocated / reserved.
The small ResNet of tests/gpu/swap_worker.py also runs swapped under the plan of a budget, to find the
largest plan budget whose swapped steps fit the capacity the first GPU run gave it (210 MiB).

Writes <out>/steady_state.json, steady_state.md and steady_state.png.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

import vmalloc
from bench.plotting import pyplot, save
from bench.traces import cached_capture
from bench.write import write_results
from swap.capture import ALLOC, FREE, ITER_END, Trace, capture, live_peak
from swap.forecast.from_trace import swapped
from swap.forecast.replay.replay import BUDGET_FRACTIONS
from swap.schedule.scheduler import InfeasibleBudget

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]
STEPS = 12
FULL = [("gpt2", 4), ("resnet50", 96), ("gpt2", 16), ("densenet121", 64), ("unet", 8)]
QUICK = [("unet", 2), ("resnet50", 8)]
POLICIES = {
    "default (step plan, growth_slack=0)": {},
    "reclaim first, no plan (step_plan=False)": {"step_plan": False},
    "growth slack, no plan (growth_slack=0.125, step_plan=False)": {"growth_slack": 0.125, "step_plan": False},
    "step plan + mid slabs (mid_chunks=4)": {"mid_chunks": 4},
}
LEGACY = {"legacy build": {}}
SMALL_RESNET_CAPACITY = 210 * MiB  # what tests/gpu/swap_worker.py's vmalloc run had on the H200
COUNTERS = ("maps", "unmaps", "set_access", "records", "queries", "capture_queries", "host_waits", "frees")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def small_resnet_trace(steps: int) -> Trace:
    """tests/gpu/swap_worker.py's ResNet (blocks 2-2-2-2, width 32, 10 classes) at batch 32, 96 x 96."""
    from swap.forecast.zoo import resnet

    return capture(lambda: resnet((2, 2, 2, 2), width=32, num_classes=10),
                   lambda n: (torch.randn(n, 3, 96, 96), torch.randint(0, 10, (n,))), 32,
                   optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), steps=steps,
                   name="small resnet")  # fmt: skip


def replay(trace: Trace, capacity: Optional[int] = None, **options: Any) -> dict[str, Any]:
    """Replays ``trace`` on a sim arena with the test backend; per-iteration counters (iterations after the
    first), the peaks, and whether it ran out of memory."""
    a = vmalloc.Arena("sim", capacity=capacity or (4 << 40), _test_backend=True, **options)

    def counters() -> dict[str, int]:
        s, c = a.stats(), a._backend_calls()
        return {"maps": s["num_maps"], "unmaps": s["num_unmaps"], "set_access": s["num_set_access"],
                "records": c.get("record_event", 0), "queries": c.get("event_done", 0),
                "capture_queries": c.get("capturing", 0), "host_waits": s["num_event_syncs"],
                "frees": s["num_free"]}  # fmt: skip

    addr: dict[int, int] = {}
    rows: list[dict[str, int]] = []
    last: Optional[dict[str, int]] = None

    def alloc(i: int, size: int, stream: int) -> bool:
        try:
            addr[i] = a.malloc(size, stream)
        except vmalloc.OutOfMemoryError:
            return False
        return True

    ok = True
    for op, i, size, stream in zip(trace.op.tolist(), trace.id.tolist(), trace.size.tolist(), trace.stream.tolist()):
        if op == ITER_END:
            now = counters()
            if last is not None:
                rows.append({k: now[k] - last[k] for k in now})
            last = now
            a._complete_events()  # the iteration's synchronize: its GPU work is done
        elif op == FREE and i in addr:
            a.free(addr.pop(i))
        elif op == ALLOC and not alloc(i, size, stream):
            ok = False
            break
    a.check_invariants()
    s = a.stats()
    steady = rows[-3:]
    return {
        "ok": ok,
        "steady": {k: sum(r[k] for r in steady) / max(1, len(steady)) for k in COUNTERS},
        "per_iteration": rows,
        "peak_requested": s["requested_bytes.all.peak"],
        "peak_allocated": s["allocated_bytes.all.peak"],
        "peak_reserved": s["reserved_bytes.all.peak"],
        "peak_slab": s["slab_bytes.all.peak"],
    }


def largest_fitting_budget(trace: Trace, capacity: int, options: dict[str, Any]) -> Optional[int]:
    """The largest plan budget (capacity x BUDGET_FRACTIONS) whose swapped steps replay within ``capacity``."""
    for f in BUDGET_FRACTIONS:
        budget = int(capacity * f)
        try:
            st = swapped(trace, budget)
        except InfeasibleBudget:
            continue
        if replay(st, capacity, **options)["ok"]:
            return budget
    return None


def run(workloads: list[tuple[str, int]], policies: dict[str, dict[str, Any]], with_small: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    out: dict[str, Any] = {"traces": [], "small_resnet": None}
    traces = [(f"{m} b{b}", cached_capture(m, b, STEPS)) for m, b in workloads]
    if with_small:
        traces.append(("small resnet b32 (96 px)", small_resnet_trace(STEPS)))
    for name, trace in traces:
        row: dict[str, Any] = {"trace": name, "requested_peak": live_peak(trace), "policies": {}}
        for label, options in policies.items():
            r = replay(trace, **options)
            r.pop("per_iteration")
            row["policies"][label] = r
        out["traces"].append(row)
        log(f"{name}: done [{time.perf_counter() - t0:.0f} s]")
    if with_small:
        trace = traces[-1][1]
        out["small_resnet"] = {
            "capacity": SMALL_RESNET_CAPACITY,
            "largest_budget": {label: largest_fitting_budget(trace, SMALL_RESNET_CAPACITY, options)
                               for label, options in policies.items()},
        }  # fmt: skip
        log(f"small resnet budgets: done [{time.perf_counter() - t0:.0f} s]")
    return out


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    built = f", vmalloc built from {meta['built_from']}" if meta.get("built_from") else ""
    lines = [
        f"Command: `{meta['command']}` ({meta['date']}, torch {meta['torch']}, vmalloc core on the sim backend"
        f"{built}).",
        "",
        f"Per steady iteration (mean of the last 3 of {meta.get('steps', STEPS)} captured training steps; "
        "the test backend completes an "
        "iteration's GPU work when it ends, so every wait inside it is a host wait): driver calls, event records "
        "and queries, capture queries (cuStreamIsCapturing), host waits; frees for scale (before sparse fences "
        "every free recorded an event). Memory over the whole run, GiB; efficiency = peak requested / peak "
        "reserved; utilization = peak allocated / peak reserved.",
        "",
        "| trace | policy | maps | unmaps | set_access | host waits | event records | event queries | capture "
        "queries | frees | requested | allocated | reserved | efficiency | utilization |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["traces"]:
        for label, r in row["policies"].items():
            s = r["steady"]
            lines.append(
                f"| {row['trace']} | {label} | {s['maps']:.0f} | {s['unmaps']:.0f} | {s['set_access']:.0f} "
                f"| {s['host_waits']:.0f} | {s['records']:.0f} | {s['queries']:.0f} | {s['capture_queries']:.0f} "
                f"| {s['frees']:.0f} | {r['peak_requested'] / 2**30:.3f} | {r['peak_allocated'] / 2**30:.3f} "
                f"| {r['peak_reserved'] / 2**30:.3f} | {r['peak_requested'] / r['peak_reserved']:.3f} "
                f"| {r['peak_allocated'] / r['peak_reserved']:.3f} |"
            )
    small = results.get("small_resnet")
    if small:
        lines += ["", f"Small ResNet (tests/gpu/swap_worker.py), swapped: the largest plan budget (capacity x "
                      f"{BUDGET_FRACTIONS[0]}, {BUDGET_FRACTIONS[1]}, ...) whose swapped steps replay within "
                      f"{small['capacity'] // MiB} MiB:", ""]  # fmt: skip
        for label, b in small["largest_budget"].items():
            lines.append(f"- {label}: " + (f"{b / MiB:.0f} MiB" if b else "none fits"))
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rows = results["traces"]
    labels = list(rows[0]["policies"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        xs = [i + j * width for i in range(len(rows))]
        calls = [sum(r["policies"][label]["steady"][k] for k in ("maps", "unmaps", "set_access", "host_waits"))
                 for r in rows]  # fmt: skip
        eff = [r["policies"][label]["peak_requested"] / r["policies"][label]["peak_reserved"] for r in rows]
        ax1.bar(xs, [c + 0.5 for c in calls], width, label=label)
        ax2.bar(xs, eff, width, label=label)
    for ax in (ax1, ax2):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
        ax.set_xticklabels([r["trace"] for r in rows], rotation=20, fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    ax1.set_yscale("log")
    ax1.set_ylabel("driver calls + host waits / steady iteration")
    ax1.set_title("maps + unmaps + set_access + host waits (+0.5, log)", fontsize=9)
    ax2.set_ylabel("efficiency (peak requested / peak reserved)")
    ax2.set_ylim(0.5, 1.01)
    ax1.legend(fontsize=7)
    save(fig, path)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.steady_state", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="two small traces")
    ap.add_argument("--legacy", action="store_true", help="the two traces of the GPU run, default options only "
                    "(for a build without growth_slack / mid_chunks), to steady_state_legacy.md")  # fmt: skip
    ap.add_argument("--built-from", default="", help="with --legacy: what the vmalloc on the path was built from")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    if args.legacy:
        results = run(FULL[:2], LEGACY, with_small=False)
        command = "python -m bench.steady_state --legacy"
        command += f" --built-from {args.built_from}" if args.built_from else ""
        results["meta"] = {"command": command, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                           "built_from": args.built_from}  # fmt: skip
        write_results(Path(args.out), "steady_state_legacy", results, markdown(results))
        return 0
    results = run(QUICK if args.quick else FULL, POLICIES, with_small=not args.quick)
    results["meta"] = {
        "command": "python -m bench.steady_state" + (" --quick" if args.quick else ""),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "steps": STEPS,
    }
    out = Path(args.out)
    write_results(out, "steady_state", results, markdown(results))
    plot(results, out / "steady_state.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
