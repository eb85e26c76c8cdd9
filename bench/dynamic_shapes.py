"""Dynamic shapes under the swap manager: a padding collator gives every batch its own sequence length.

    python -m bench.dynamic_shapes                # 60 iterations, 5 timing rounds (about 12 minutes on 2 shared cores)
    python -m bench.dynamic_shapes --quick        # 20 iterations, 1 round: a smoke run

HF GPT-2 (4 layers, d=128, 4 heads, vocab 512; bench.joint_cpu's), AdamW, batch 8. The dynamic run draws each
iteration's length from 32..128 in steps of 8 (13 lengths, seeded); the fixed run uses 128 throughout. The
budget is 60 % of the dynamic run's peak without the manager (that of length 128); the manager runs at its
default settings (strategy, ``min_bytes`` 1 MiB), as a user's would; ``--min-bytes`` sets another. At 1 MiB
several of this model's saved tensors cross ``min_bytes`` between lengths (Note [A plan's variables, whatever
their size] in swap.runtime.activations.plan_book).

1. Checks, each run under its own LiveBytesMeter: the manager's run bitwise equal to plain training (losses,
   parameters, buffers), every iteration within the budget, and what it reported: profiling iterations, re-plans,
   shapes seen, kept plans reused and derived from a larger shape (Note [Plans by input shape] in
   swap.runtime.activations.plan_book), and where the planning work fell (``plan_events``): the target is none
   of it, profiles and re-plans, in the second half of the run.
2. Timing: rounds of the four runs interleaved (plain dynamic, managed dynamic, plain fixed, managed fixed), no
   meter, one compute thread. A ratio is the managed run's summed step times over the plain run's, over the whole
   run and over its last 20 iterations; the figure is the median over rounds.

Target: the dynamic run's last-20 ratio within 1.15x of the fixed run's, and no profiling iteration, re-plan or
refinement of a length seen before in the second half of any dynamic run (a length first drawn there is refined
once: Note [A first-seen length's refinement]). The load average (``os.getloadavg``) before and after is recorded: the
machine is shared. Writes <out>/<stem>.json and .md.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import platform
import random
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

import swap
from bench.joint_cpu import VOCAB, Workload, gpt2
from bench.joint_cpu import train as train_tensors
from bench.write import write_results

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.dynamic_shapes")
BATCH, FRACTION, TARGET, TAIL = 8, 0.6, 1.15, 20
LENGTHS = list(range(32, 129, 8))  # 13 lengths
DEFAULT_MIN_BYTES = inspect.signature(swap.SwapManager).parameters["min_bytes"].default
REPORTED = ("status", "iterations", "profiling_iterations", "replans", "shapes_seen", "plans_reused",
            "plans_derived", "plans_refined", "overruns", "recompute_plan", "swapped_out_bytes")  # fmt: skip


def workload(lengths: list[int], label: str) -> Workload:
    """GPT-2 trained at ``lengths`` (one per iteration), logging its progress every 10 iterations."""

    def batch(it: int) -> torch.Tensor:
        if it % 10 == 0:
            log.info("%s: iteration %d/%d", label, it, len(lengths))
        return torch.randint(0, VOCAB, (BATCH, lengths[it]), generator=torch.Generator().manual_seed(it))

    return Workload(label, gpt2, batch, lambda m, x: m(input_ids=x, labels=x).loss, [],
                    lambda p: torch.optim.AdamW(p, lr=1e-4))  # fmt: skip


def train(w: Workload, iterations: int, context: Optional[Any] = None,
          meter: Optional[swap.LiveBytesMeter] = None) -> dict[str, Any]:  # fmt: skip
    """bench.joint_cpu's ``train``, its final parameters and buffers kept as numpy copies: the CPU budget counts
    every live CPU tensor in the process, so one run's tensors kept for the bitwise check would count against the
    next run's budget (Note [What the CPU budget counts] in swap.runtime.machine.memory)."""
    out = train_tensors(w, iterations, context=context, meter=meter)
    out["params"] = [t.numpy().copy() for t in out["params"]]
    return out


def bitwise(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same losses, parameters and buffers, bit for bit."""
    return a["losses"] == b["losses"] and all(np.array_equal(x, y) for x, y in zip(a["params"], b["params"]))


def second_half(events: list[tuple[int, str]], lengths: list[int]) -> dict[str, int]:
    """The planning work ``events`` (the report's ``plan_events``) in the second half of a run of ``lengths``:
    profiles, re-plans, and refinements, those of a length first drawn at the iteration before
    (``refine_first``) apart from the others (``refine_again``).

    Note [A first-seen length's refinement]
    A refinement is not a re-plan. A length first drawn at iteration i runs i under the plan of a larger length
    (its sizes upper bounds: within the budget, Note [Plans by input shape] in
    swap.runtime.activations.plan_book), and at iteration i + 1's start (the event's iteration) the scheduler
    alone plans it again on the sizes i measured, so that it swaps no more than it needs: no profiling, no
    iteration under the conservative plan, under 6 ms of scheduling against steps of 120-1,430 ms here (measured
    around ``Lifecycle.replan`` on the checked run, 2026-11-28). It comes once per length, so a length first
    drawn in the second half (112 at iteration 32 with seed 0) is refined there and never again; skipping it
    would keep that length on the larger one's plan for the rest of the run. So the target counts it apart,
    and a refinement of a length drawn before counts against the target as a re-plan would: its kept plan was
    lost (or never kept: the length of the first profiling iteration, whose profile gives way to the second's
    when their sequences differ, 80 at iteration 0 with seed 0, refined at 3)."""
    out = {"profile": 0, "replan": 0, "refine_first": 0, "refine_again": 0}
    for i, kind in events:
        if i < len(lengths) // 2:
            continue
        if kind == "refine":
            kind = "refine_first" if lengths[i - 1] not in lengths[: i - 1] else "refine_again"
        out[kind] += 1
    return out


def managed(w: Workload, lengths: list[int], budget: int, meter: Optional[swap.LiveBytesMeter] = None,
            min_bytes: Optional[str] = None) -> dict:  # fmt: skip
    """A run of ``w`` at ``lengths`` (one per iteration) under the manager at its defaults (``min_bytes`` None:
    the manager's own)."""
    iterations = len(lengths)
    kw = {} if min_bytes is None else {"min_bytes": min_bytes}
    sm = swap.SwapManager(budget=budget, device="cpu", **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", swap.BudgetWarning)
        out = train(w, iterations, context=sm, meter=meter)
    r = sm.report()
    out["report"] = {k: r.get(k) for k in REPORTED}  # .get: an older runtime lacks the newer keys
    events = r.get("plan_events") or []
    out["report"]["plan_events"] = events
    out["report"]["second_half"] = second_half(events, lengths)
    out["warnings"] = [str(c.message) for c in caught]
    return out


def ratios(sm: list[float], plain: list[float]) -> dict[str, float]:
    return {"run": sum(sm) / sum(plain), "last": sum(sm[-TAIL:]) / sum(plain[-TAIL:])}


def measure(iterations: int, rounds: int, seed: int, min_bytes: Optional[str] = None) -> dict[str, Any]:
    rng = random.Random(seed)
    arms = {"dynamic": [rng.choice(LENGTHS) for _ in range(iterations)], "fixed": [max(LENGTHS)] * iterations}
    out: dict[str, Any] = {"lengths": arms["dynamic"], "checks": {}, "timing": {}}
    plain = {k: train(workload(v, f"{k}, plain, metered"), iterations, meter=swap.LiveBytesMeter("cpu"))
             for k, v in arms.items()}  # fmt: skip
    peak = max(plain["dynamic"]["peaks"])
    budget = out["budget_bytes"] = int(FRACTION * peak)
    out["plain_peak_bytes"] = peak
    log.info("plain peak %.1f MiB, budget %.1f MiB", peak / 2**20, budget / 2**20)
    for k, v in arms.items():
        run = managed(workload(v, f"{k}, managed, metered"), v, budget, swap.LiveBytesMeter("cpu"), min_bytes)
        out["checks"][k] = {"bitwise_equal": bitwise(plain[k], run), "peak_bytes": max(run["peaks"]),
                            "within_budget": max(run["peaks"]) <= budget, "report": run["report"],
                            "warnings": run["warnings"]}  # fmt: skip
        log.info("%s: %s", k, out["checks"][k]["report"])
    for r in range(rounds):
        for k, v in arms.items():
            log.info("round %d/%d, %s", r + 1, rounds, k)
            p = train(workload(v, f"{k}, plain, round {r + 1}"), iterations)
            m = managed(workload(v, f"{k}, managed, round {r + 1}"), v, budget, min_bytes=min_bytes)
            t = out["timing"].setdefault(k, {"wall": [], "cpu": [], "reports": []})
            t["wall"].append(ratios(m["wall"], p["wall"]))
            t["cpu"].append(ratios(m["cpu"], p["cpu"]))
            t["reports"].append(m["report"])
    for t in out["timing"].values():
        t["median"] = {c: {s: statistics.median(x[s] for x in t[c]) for s in ("run", "last")} for c in ("wall", "cpu")}
    dyn, fix = out["timing"]["dynamic"]["median"]["wall"]["last"], out["timing"]["fixed"]["median"]["wall"]["last"]
    out["last_vs_fixed"] = dyn / fix
    cpu = {k: out["timing"][k]["median"]["cpu"]["last"] for k in arms}
    out["last_vs_fixed_cpu"] = cpu["dynamic"] / cpu["fixed"]
    quiet = all(not (x["second_half"]["profile"] or x["second_half"]["replan"] or x["second_half"]["refine_again"])
                for x in [out["checks"]["dynamic"]["report"]] + out["timing"]["dynamic"]["reports"])  # fmt: skip
    out["second_half_quiet"] = quiet
    out["target_met"] = out["last_vs_fixed"] <= TARGET and quiet
    return out


def markdown(r: dict[str, Any], command: str, meta: dict[str, Any]) -> str:
    mib = 2**20
    tm = r["timing"]
    load = ", ".join(f"{x:.1f}" for x in meta["load_before"]) + " before, " + ", ".join(
        f"{x:.1f}" for x in meta["load_after"]) + " after"  # fmt: skip
    lines = [
        "# Dynamic shapes: a sequence length per batch", "",
        f"`{command}` on {meta['machine']}, torch {meta['torch']}, one compute thread; {meta['iterations']} "
        f"iterations per run, {meta['rounds']} interleaved timing round(s); load average (1, 5, 15 min) {load}. "
        f"HF GPT-2 (4 layers, d=128, vocab 512), AdamW, batch {BATCH}; lengths drawn from "
        f"{min(LENGTHS)}..{max(LENGTHS)} in steps of 8 ({len(LENGTHS)} lengths), or {max(LENGTHS)} throughout "
        f"(fixed). Budget {r['budget_bytes'] / mib:.1f} MiB ({int(FRACTION * 100)} % of the plain peak, "
        f"{r['plain_peak_bytes'] / mib:.1f} MiB), the default strategy, min_bytes {meta['min_bytes']}."
        + (f" Runtime: {meta['label']}." if meta.get("label") else ""),
        "", "| | dynamic | fixed 128 |", "|---|---|---|",
    ]  # fmt: skip
    c = r["checks"]

    def row(label: str, cell: Any) -> None:
        lines.append(f"| {label} | {cell('dynamic')} | {cell('fixed')} |")

    def half(x: dict[str, Any]) -> str:
        h = x["second_half"]
        return f"{h['profile']}/{h['replan']}/{h['refine_first']}/{h['refine_again']}"

    row("bitwise equal to plain", lambda k: c[k]["bitwise_equal"])
    row("every iteration within budget", lambda k: f"{c[k]['within_budget']} ({c[k]['peak_bytes'] / mib:.1f} MiB)")
    for key in REPORTED:
        row(key.replace("_", " "), lambda k, key=key: c[k]["report"][key])
    row("second half: profiles/re-plans/refinements of a first-drawn length/other refinements",
        lambda k: half(c[k]["report"]))  # fmt: skip
    for clock in ("wall", "cpu"):
        row(f"step ratio to plain over the run ({clock})", lambda k, s=clock: f"{tm[k]['median'][s]['run']:.3f}")
        row(f"... over the last {TAIL} ({clock})", lambda k, s=clock: f"{tm[k]['median'][s]['last']:.3f}")
    row("profiling iterations, re-plans per timed round",
        lambda k: ", ".join(f"{x['profiling_iterations']}/{x['replans']}" for x in tm[k]["reports"]))  # fmt: skip
    row("... second half: profiles/re-plans/first-drawn/other refinements per timed round",
        lambda k: ", ".join(half(x) for x in tm[k]["reports"]))  # fmt: skip
    ratio_ok = r["last_vs_fixed"] <= TARGET
    verdict = "met" if ratio_ok else f"missed by {(r['last_vs_fixed'] / TARGET - 1) * 100:.1f} %"
    lines += ["", f"**Last {TAIL} iterations, dynamic ratio / fixed ratio (wall): {r['last_vs_fixed']:.3f}; target "
              f"<= {TARGET}: {verdict}** (CPU time of the process: {r['last_vs_fixed_cpu']:.3f}). **No profiling "
              f"iteration, re-plan or refinement of a length seen before in the second half of any dynamic run: "
              f"{r['second_half_quiet']}.**"]  # fmt: skip
    events = c["dynamic"]["report"]["plan_events"]
    lengths = r["lengths"]

    def event(i: int, e: str) -> str:
        if e != "refine":
            return f"{i} {e}"
        n = lengths[i - 1]
        seen = "first" if n not in lengths[: i - 1] else "again, first"
        return f"{i} refine ({n}, {seen} drawn at {lengths.index(n)})"

    lines += ["", "Where the checked dynamic run's planning work fell (iteration from 0, what; a refinement is a "
              "larger length's plan planned again by the scheduler alone on a new length's own sizes, at the "
              "start of the iteration after that length's first, no profiling: Note [Plans by input shape]; it "
              "is not a re-plan: Note [A first-seen length's refinement] in bench/dynamic_shapes.py): "
              + (", ".join(event(i, e) for i, e in events) or "none") + "."]  # fmt: skip
    lines += ["", f"Lengths drawn: {r['lengths']}.", ""]
    for k in ("dynamic", "fixed"):
        lines += [f"- {k}, warning: {w}" for w in c[k]["warnings"]]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="20 iterations, one round (a smoke run)")
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="the draw of lengths")
    ap.add_argument("--min-bytes", default=None, help="the manager's min_bytes (default: its own default)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--stem", default="dynamic_shapes")
    ap.add_argument("--label", default="", help="what runtime was measured, for the results (e.g. an older commit "
                    "on PYTHONPATH: its bench/ needs this file copied in)")  # fmt: skip
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    torch.set_num_threads(1)
    iterations, rounds = (TAIL, 1) if args.quick else (args.iterations, args.rounds)
    load_before = os.getloadavg()
    results = measure(iterations, rounds, args.seed, args.min_bytes)
    meta = {"machine": platform.machine() + ", " + platform.processor(), "torch": torch.__version__,
            "iterations": iterations, "rounds": rounds, "label": args.label, "load_before": load_before,
            "load_after": os.getloadavg(),
            "min_bytes": args.min_bytes or f"{DEFAULT_MIN_BYTES} (the default)"}  # fmt: skip
    results["meta"] = meta
    command = "python -m bench.dynamic_shapes" + (" --quick" if args.quick else "") + "".join(
        f" --{k.replace('_', '-')} {getattr(args, k)}" for k in ("iterations", "rounds", "seed", "stem", "label",
                                                                   "min_bytes")
        if getattr(args, k) != ap.get_default(k) and not (args.quick and k in ("iterations", "rounds")))  # fmt: skip
    write_results(args.out, args.stem, results, markdown(results, command, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
