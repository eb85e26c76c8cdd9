"""vmalloc's growth slack: utilization against driver calls per steady iteration, by growth_slack.

    python -m bench.fragmentation_slack            # the traces of bench.fragmentation and bench.steady_state
    python -m bench.fragmentation_slack --quick    # two small traces

The growth slack (Note [Reuse before growth] in csrc/allocator.cpp) lets a cache miss create chunks instead of
reclaiming cached ones, within (1 + growth_slack) x the most chunks ever in use: fewer maps once a training
step repeats, more memory reserved. Two targets pull apart (issue 38): utilization (peak allocated / peak
reserved) >= 0.99 on every trace of bench.fragmentation (3 steps, unlimited capacity, with and without
swapping), and no map, unmap or host wait per steady iteration on the traces of bench.steady_state (12 steps).
The default meets both with neither: the step plan (Note [Step plan] in csrc/allocator_plan.cpp) over
growth_slack=0; the growth_slack columns turn the plan off (step_plan=False) to show the trade-off it removes.
This replays both sets of traces through vmalloc's sim core with the test backend of bench.steady_state (an
iteration's GPU work completes when it ends, so every wait inside it is a host wait) at several growth_slack
values and reports, per trace and value: utilization, the slack held beyond the most ever in use
(stats()["slack_bytes.all.peak"], Note [Slack reported apart]) and the maps, unmaps and host waits of the
steady iterations (the last one of a fragmentation trace, the mean of the last 3 of a steady-state trace).

Writes <out>/fragmentation_slack.json and fragmentation_slack.md.
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
from bench.fragmentation import FULL as FRAGMENTATION
from bench.fragmentation import swap_budget
from bench.steady_state import FULL as STEADY
from bench.steady_state import STEPS as STEADY_STEPS
from bench.traces import cached_capture
from bench.write import write_results
from swap.capture import ALLOC, FREE, ITER_END, Trace
from swap.forecast.from_trace import swapped

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30
SLACKS = (0.0, 0.008, 0.03, 0.125, None)  # None: the default (the step plan over growth_slack=0)
QUICK_FRAGMENTATION = {"unet": (2,)}
QUICK_STEADY = [("unet", 2)]
FRAGMENTATION_STEPS = 3  # as bench.fragmentation


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def replay(trace: Trace, growth_slack: Optional[float], touched: bool = False) -> dict[str, Any]:
    """Replays ``trace`` at unlimited capacity; utilization, slack and per-iteration driver calls. With
    ``touched``, also the chunks that the last iteration's allocations (and those live at its start) touched:
    what reserved memory a steady iteration uses, were the untouched slack given back (``touched_bytes``)."""
    options = {} if growth_slack is None else {"growth_slack": growth_slack, "step_plan": False}
    a = vmalloc.Arena("sim", capacity=4 << 40, _test_backend=True, **options)
    chunk = a.chunk_size
    keys = ("num_maps", "num_unmaps", "num_event_syncs")
    addr: dict[int, int] = {}
    sizes: dict[int, int] = {}
    rows: list[dict[str, int]] = []
    last: Optional[dict[str, int]] = None
    seen: set[int] = set()  # chunk indices touched in this iteration

    def chunks(p: int, n: int) -> range:
        return range(p // chunk, (p + n + chunk - 1) // chunk)

    for op, i, size, stream in zip(trace.op.tolist(), trace.id.tolist(), trace.size.tolist(), trace.stream.tolist()):
        if op == ITER_END:
            s = a.stats()
            now = {k: s[k] for k in keys}
            if last is not None:
                rows.append({k: now[k] - last[k] for k in keys})
            last = now
            a._complete_events()  # the iteration's synchronize
            if touched:
                if rows:
                    rows[-1]["touched"] = len(seen)
                seen = {c for j, p in addr.items() for c in chunks(p, sizes[j])}
        elif op == FREE and i in addr:
            a.free(addr.pop(i))
        elif op == ALLOC:
            addr[i] = a.malloc(size, stream)
            if touched:
                sizes[i] = size
                seen.update(chunks(addr[i], size))
    s = a.stats()
    out = {
        "peak_allocated": s["allocated_bytes.all.peak"],
        "peak_reserved": s["reserved_bytes.all.peak"],
        "utilization": s["allocated_bytes.all.peak"] / s["reserved_bytes.all.peak"],
        "peak_slack": s["slack_bytes.all.peak"],
        "per_iteration": rows,
    }
    if touched and rows:
        out["touched_bytes"] = rows[-1]["touched"] * chunk
    return out


def steady(r: dict[str, Any], last: int) -> dict[str, float]:
    rows = r["per_iteration"][-last:]
    keys = ("num_maps", "num_unmaps", "num_event_syncs")
    return {k: sum(row[k] for row in rows) / max(1, len(rows)) for k in keys}


def traces(quick: bool) -> list[tuple[str, str, Trace]]:
    """(set, name, trace): bench.fragmentation's traces with and without swapping, bench.steady_state's."""
    out = []
    for model, batches in (QUICK_FRAGMENTATION if quick else FRAGMENTATION).items():
        for batch in batches:
            t = cached_capture(model, batch, FRAGMENTATION_STEPS)
            budget = swap_budget(t)
            out.append(("fragmentation", f"{model} b{batch}", t))
            out.append(("fragmentation", f"{model} b{batch} swap@{budget / GiB:.2f}", swapped(t, budget)))
    for model, batch in QUICK_STEADY if quick else STEADY:
        out.append(("steady_state", f"{model} b{batch}", cached_capture(model, batch, STEADY_STEPS)))
    return out


def run(quick: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    rows = []
    for kind, name, trace in traces(quick):
        row: dict[str, Any] = {"set": kind, "trace": name, "slack": {}}
        for slack in SLACKS:
            r = replay(trace, slack, touched=kind == "steady_state" and slack == 0.125)
            r["steady"] = steady(r, 1 if kind == "fragmentation" else 3)
            r.pop("per_iteration")
            row["slack"]["default" if slack is None else str(slack)] = r
        rows.append(row)
        log(f"{kind} {name}: done [{time.perf_counter() - t0:.0f} s]")
    return {"traces": rows}


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    labels = list(results["traces"][0]["slack"]) if results["traces"] else []
    head = " | ".join(
        "default (step plan)" if label == "default" else f"growth_slack={label}, no plan" for label in labels
    )
    lines = [
        f"Command: `{meta['command']}` ({meta['date']}, torch {meta['torch']}, vmalloc core on the sim backend, "
        "unlimited capacity).",
        "",
        "Each cell: utilization (peak allocated / peak reserved), peak slack (GiB held beyond the most ever in use, "
        "stats()['slack_bytes.all.peak']), and maps / unmaps / host waits per steady iteration (fragmentation "
        f"traces: {FRAGMENTATION_STEPS} steps, the last iteration; steady-state traces: {STEADY_STEPS} steps, the "
        "mean of the last 3). Targets: utilization >= 0.99 on every fragmentation trace, 0 / 0 / 0 on every "
        "steady-state trace.",
        "",
        f"| set | trace | {head} |",
        "|---|---|" + "---|" * len(labels),
    ]
    for row in results["traces"]:
        cells = []
        for label in labels:
            r = row["slack"][label]
            s = r["steady"]
            cells.append(f"{r['utilization']:.3f}, {r['peak_slack'] / GiB:.2f}, "
                         f"{s['num_maps']:.0f} / {s['num_unmaps']:.0f} / {s['num_event_syncs']:.0f}")  # fmt: skip
        lines.append(f"| {row['set']} | {row['trace']} | " + " | ".join(cells) + " |")
    lines += ["", "Per growth_slack: the lowest utilization over the fragmentation traces, and the steady-state "
              "traces with a map, unmap or host wait per steady iteration:", ""]  # fmt: skip
    for label in labels:
        frag = [r["slack"][label]["utilization"] for r in results["traces"] if r["set"] == "fragmentation"]
        busy = [r["trace"] for r in results["traces"] if r["set"] == "steady_state" and any(
            v > 0 for v in r["slack"][label]["steady"].values())]  # fmt: skip
        name = "default (step plan)" if label == "default" else f"growth_slack={label}, no plan"
        lines.append(f"- {name}: lowest utilization {min(frag):.3f}; steady-state traces with "
                     f"driver calls or host waits: {', '.join(busy) or 'none'}")  # fmt: skip
    lines += ["", "Slack given back once steady, at best (growth_slack=0.125 without the plan, the default before it): "
              "its last steady iteration touches only some of "
              "the memory it reserves (chunks of its allocations and of those live at its start). Giving back the "
              "rest (untouched slack) costs no map in a repeating step; peak allocated / touched is then the "
              "steady utilization (the peak reserved of the growing iterations stays):", ""]  # fmt: skip
    for row in results["traces"]:
        r = row["slack"].get("0.125", {})
        if "touched_bytes" in r:
            lines.append(f"- {row['trace']}: reserved {r['peak_reserved'] / GiB:.3f} GiB, touched "
                         f"{r['touched_bytes'] / GiB:.3f} GiB, peak allocated / touched "
                         f"{r['peak_allocated'] / r['touched_bytes']:.3f}")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fragmentation_slack", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="two small traces")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    results = run(args.quick)
    results["meta"] = {
        "command": "python -m bench.fragmentation_slack" + (" --quick" if args.quick else ""),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "slacks": [s for s in SLACKS],
    }
    write_results(Path(args.out), "fragmentation_slack" + ("_quick" if args.quick else ""), results,
                  markdown(results))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
