"""The joint strategy measured for real on CPU: HF GPT-2 (4 layers) and a ResNet at a budget of
40 % of the unswapped peak, against full checkpointing by hand.

    python -m bench.joint_cpu            # both models, 7 rounds (about ten minutes on 2 shared cores)
    python -m bench.joint_cpu --quick    # one round, fewer iterations: a smoke run

Per model, four arms (``ARMS``), each a fresh model trained alike:
1. ``plain``: no manager nor checkpointing, under a LiveBytesMeter: the reference losses, parameters and
   buffers, and the unswapped peak; the budget is 40 % of it.
2. ``auto``: ``SwapManager(budget)`` (strategy "auto", the default);
   ``checkpoint``: every transformer layer / bottleneck in ``torch.utils.checkpoint`` by hand, no manager;
   ``checkpoint_window``: the manager held to checkpointing the same blocks, swapping what they still save
   with the window policy (hand checkpointing alone may not meet the budget).
   Each is run once under an independent LiveBytesMeter: bitwise equal to plain (losses, parameters,
   buffers)? every iteration within the budget, the profiling ones included?
3. Timing: rounds of the four arms, interleaved (plain, auto, checkpoint, checkpoint_window, plain, ...); the
   last iterations of each run are timed (after the manager has planned; wall clock and CPU time of the
   process, the copy threads included); a ratio is the median of auto's steps over the median of the other's.

One compute thread (``--threads``): the copy workers then have the second core, as a GPU's copy engines do not
compete with its kernels; the machine is shared with other work, hence the interleaving and medians.

Writes <out>/joint_cpu.json, joint_cpu.md and joint_cpu.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import swap
from bench.checkpointing import blocks_at, checkpoint_blocks
from bench.metering import metered
from bench.plotting import pyplot, save
from swap.forecast import zoo as models
from swap.joint.regions import RecomputePlan, Region
from swap.joint.search import JointResult, Strategy

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.joint_cpu")
FRACTION = 0.4
VOCAB = 512


class Workload:
    """A model, its batches, its optimizer and the paths of its blocks (what hand checkpointing wraps)."""

    def __init__(self, name: str, build: Callable[[], torch.nn.Module], batch: Callable[[int], Any],
                 loss: Callable[[torch.nn.Module, Any], torch.Tensor], blocks: list[str],
                 optimizer: Callable[[Any], torch.optim.Optimizer]) -> None:  # fmt: skip
        self.name, self.build, self.batch, self.loss, self.blocks, self.optimizer = (
            name, build, batch, loss, blocks, optimizer)  # fmt: skip


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # Activations dominate (as at real sizes): a small vocabulary and width, 256 tokens; the model state
    # (parameters, gradients, AdamW's moments) is 4 % of the peak.
    cfg = GPT2Config(n_layer=4, n_embd=128, n_head=4, n_positions=256, vocab_size=VOCAB, bos_token_id=0,
                     eos_token_id=0, use_cache=False)  # the cache is off when training with checkpointing  # fmt: skip
    return GPT2LMHeadModel(cfg)


def resnet() -> torch.nn.Module:
    torch.manual_seed(0)
    return models.resnet((3, 4, 6, 3), width=8, num_classes=10)  # ResNet-50's layout at 1/8 of its width


def _tokens(it: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (8, 256), generator=torch.Generator().manual_seed(it))


def _images(it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(it)
    return torch.randn(16, 3, 96, 96, generator=g), torch.randint(0, 10, (16,), generator=g)


WORKLOADS = {
    "gpt2": Workload(
        "HF GPT-2 (4 layers, d=128, 4 heads, 256 tokens, vocab 512, batch 8), AdamW", gpt2, _tokens,
        lambda m, x: m(input_ids=x, labels=x).loss, [f"transformer.h.{i}" for i in range(4)],
        lambda p: torch.optim.AdamW(p, lr=1e-4)),
    "resnet": Workload(
        "ResNet-50 layout at width 8 (swap.forecast.zoo, bottlenecks 3-4-6-3, 96x96, batch 16), SGD", resnet, _images,
        lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), [f"blocks.{i}" for i in range(16)],
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
}  # fmt: skip


def train(w: Workload, iterations: int, context: Optional[Any] = None, meter: Optional[swap.LiveBytesMeter] = None,
          hand: bool = False) -> dict[str, Any]:  # fmt: skip
    """Trains a fresh model; per iteration: loss, wall and CPU seconds, and the meter's peak if given."""
    gc.collect()
    model = w.build()
    if hand:  # full checkpointing as a user writes it: every block in a non-reentrant checkpoint
        checkpoint_blocks(blocks_at(model, w.blocks))
    opt = w.optimizer(model.parameters())
    out: dict[str, Any] = {"losses": [], "wall": [], "cpu": [], "peaks": []}
    with metered(meter, context):
        for it in range(iterations):
            batch = w.batch(it)
            t0, c0 = time.perf_counter(), time.process_time()
            loss = w.loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out["wall"].append(time.perf_counter() - t0)
            out["cpu"].append(time.process_time() - c0)
            out["losses"].append(loss.item())
            del loss, batch
            if meter is not None:
                out["peaks"].append(meter.reset_window())
    out["params"] = [p.detach().clone() for p in model.parameters()] + [b.detach().clone() for b in model.buffers()]
    out["n_params"] = len(list(model.parameters()))
    return out


def bitwise(a: dict[str, Any], b: dict[str, Any], tensors: Optional[int] = None) -> bool:
    """Same losses, and the first ``tensors`` of ``params`` (all: parameters, then buffers) bitwise equal."""
    return a["losses"] == b["losses"] and all(
        torch.equal(x, y) for x, y in zip(a["params"][:tensors], b["params"][:tensors]))


def manager(budget: int, blocks: Optional[list[str]] = None) -> swap.SwapManager:
    """``strategy="auto"``; with ``blocks``, held to checkpointing exactly those modules (what the hand-written
    arm checkpoints) and swapping what they still save with the window policy, instead of the search."""
    sm = swap.SwapManager(budget=budget, device="cpu", min_bytes="16KiB")
    if blocks is not None:
        plan = RecomputePlan(tuple(Region(p) for p in blocks))
        sm._joint.choose = lambda ev: JointResult(ev.evaluate(Strategy("checkpoint_window", plan, "window")), {},
                                                  ev.evaluations)  # fmt: skip
    return sm


# The arms, each a fresh model trained alike: no manager nor checkpointing (over the budget: the compute
# alone); auto; every block checkpointed by hand (no manager); and the manager held to checkpointing the same
# blocks with what they still save swapped by the window policy, which meets budgets that hand
# checkpointing alone does not.
ARMS = ("plain", "auto", "checkpoint", "checkpoint_window")
COSTS = ("stall", "recompute", "swapped_out_bytes")


def arm(name: str, w: Workload, budget: int, iterations: int, meter: Optional[swap.LiveBytesMeter] = None) -> dict:
    sm = None if name in ("plain", "checkpoint") else manager(budget, None if name == "auto" else w.blocks)
    out = train(w, iterations, context=sm, meter=meter, hand=name == "checkpoint")
    out["report"] = sm.report() if sm is not None else None
    return out


def check(name: str, w: Workload, budget: int, iterations: int, plain: dict[str, Any]) -> dict[str, Any]:
    """One run of ``name`` under an independent meter: bitwise equal to ``plain``? every iteration within the
    budget? and what the manager reported."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", swap.BudgetWarning)
        run = plain if name == "plain" else arm(name, w, budget, iterations, meter=swap.LiveBytesMeter("cpu"))
    out = {"bitwise_equal": bitwise(plain, run), "peak_bytes": max(run["peaks"]), "peaks": run["peaks"],
           "params_equal": bitwise(plain, run, run["n_params"]),
           "within_budget": max(run["peaks"]) <= budget, "warnings": [str(c.message) for c in caught]}  # fmt: skip
    rep = run.get("report")
    if rep is not None:
        out.update(status=rep["status"], plan=rep["recompute_plan"], overruns=rep["overruns"], notes=rep["notes"],
                   simulated_step_seconds=rep["simulated_step_seconds"],
                   modules=[r for r in rep["modules"] if r["kept_bytes"] or r["swapped_bytes"]
                            or r["recomputed_bytes"]],
                   not_recomputable=rep["not_recomputable"], not_checkpointed=rep["not_checkpointed"])  # fmt: skip
    return out


def measure(key: str, w: Workload, rounds: int, iterations: int, timed: int) -> dict[str, Any]:
    log.info("%s: plain run under a meter", key)
    plain = train(w, iterations, meter=swap.LiveBytesMeter("cpu"))
    peak = max(plain["peaks"])
    budget = int(peak * FRACTION)
    log.info("%s: unswapped peak %.1f MiB, budget %.1f MiB", key, peak / 2**20, budget / 2**20)
    checks = {}
    for name in ARMS:
        log.info("%s: %s under a meter", key, name)
        checks[name] = check(name, w, budget, iterations, plain)
    times: dict[str, list[list[float]]] = {k: [] for name in ARMS for k in (name, name + "_cpu")}
    costs: dict[str, list[dict[str, Any]]] = {"auto": [], "checkpoint_window": []}
    for r in range(rounds):
        for name in ARMS:  # interleaved: the machine's load drifts alike for each
            log.info("%s: round %d/%d, %s", key, r + 1, rounds, name)
            run = arm(name, w, budget, iterations)
            times[name].append(run["wall"][-timed:])
            times[name + "_cpu"].append(run["cpu"][-timed:])
            rep = run["report"]
            if rep is not None:  # per iteration over the run (profiling included): what the time went to
                n = rep["iterations"]
                costs[name].append({"stall": rep["stall_seconds"] / n, "recompute": rep["recompute_seconds"] / n,
                                    "swapped_out_bytes": rep["swapped_out_bytes"] / n, "status": rep["status"],
                                    "plan": rep["recompute_plan"]})  # fmt: skip
    med = {k: statistics.median([t for rnd in v for t in rnd]) for k, v in times.items()}
    return {
        "workload": w.name, "unswapped_peak_bytes": peak, "budget_bytes": budget, "checks": checks,
        "times": times, "median_wall_seconds": {n: med[n] for n in ARMS},
        "median_cpu_seconds": {n: med[n + "_cpu"] for n in ARMS},
        "per_step": {n: {k: statistics.median([c[k] for c in cs]) for k in COSTS} for n, cs in costs.items()},
        "timed_runs": costs,
        "ratio_wall": med["auto"] / med["checkpoint"], "ratio_cpu": med["auto_cpu"] / med["checkpoint_cpu"],
        "ratio_wall_vs_checkpoint_window": med["auto"] / med["checkpoint_window"],
        "round_ratios": [statistics.median(a) / statistics.median(c)
                         for a, c in zip(times["auto"], times["checkpoint"])],
    }  # fmt: skip


LABELS = {"plain": "no manager, no checkpointing", "auto": "auto (SwapManager)",
          "checkpoint": "full checkpointing by hand", "checkpoint_window": "full checkpointing + window (SwapManager)"}


TICKS = {"plain": "plain\n(over budget)", "auto": "auto", "checkpoint": "checkpointing\nby hand",
         "checkpoint_window": "checkpointing\n+ window"}


def dominates(r: dict[str, Any]) -> str:
    """What the measured costs say about auto against hand checkpointing (the results' last paragraph)."""
    ms = {n: t * 1e3 for n, t in r["median_wall_seconds"].items()}
    a, h = r["per_step"]["auto"], r["checks"]["checkpoint"]
    text = (f"the step without manager or checkpointing takes {ms['plain']:.0f} ms (over the budget). Hand "
            f"checkpointing adds {ms['checkpoint'] - ms['plain']:.0f} ms (every block's forward again) and "
            f"{'meets' if h['within_budget'] else 'does not meet'} the budget (peak {h['peak_bytes'] / 2**20:.1f} MiB "
            f"against {r['budget_bytes'] / 2**20:.1f} MiB). auto adds {ms['auto'] - ms['plain']:.0f} ms; per "
            f"iteration (medians over its timed runs, profiling iterations included) it recomputed for "
            f"{a['recompute'] * 1e3:.0f} ms, waited {a['stall'] * 1e3:.0f} ms for copies and copied out "
            f"{a['swapped_out_bytes'] / 2**20:.1f} MiB; the rest is the manager's own work on CPU: its memory meter "
            "(a dispatch mode on every operator), its hooks and the copies themselves, which on CPU are memcpys on "
            "the same 2 shared cores (bench/results/swap_overhead.md measures that overhead alone: 1.23x on a "
            "4-layer GPT, 1.72x on a width-16 ResNet); on a GPU the copies run on copy engines.")  # fmt: skip
    if r["ratio_wall"] > 1 or r["ratio_cpu"] > 1:
        cw = r["checks"]["checkpoint_window"]
        if "region" in cw["plan"]:
            text += (f" At the same budget, with the same blocks checkpointed and what they save swapped, the "
                     f"manager takes {ms['checkpoint_window']:.0f} ms (auto / it = "
                     f"{r['ratio_wall_vs_checkpoint_window']:.3f}).")
        else:
            note = next((n for n in cw["notes"] if "no recompute plan fits" in n), "")
            why = note.split(": ", 2)[-1].split(". Live there")[0]
            text += (" Checkpointing every block cannot meet this budget with swapping either: the manager held to "
                     f"it found no plan that fits ({why}: the rerun block's activations are held through its "
                     "backward), so at this budget only swapping fits, and auto swaps.")
    if not h["bitwise_equal"] and h["params_equal"]:
        text += (" Hand checkpointing's parameters are bitwise equal but its buffers are not: its rerun updates "
                 "BatchNorm's running statistics a second time (the manager's reruns write scratch copies).")
    return text


def _counts(runs: list[dict[str, Any]]) -> str:
    plans = [c["plan"] for c in runs]
    return ", ".join(f"{p} x{plans.count(p)}" for p in dict.fromkeys(plans))


def _row(label: str, cell: Callable[[str], Any]) -> str:
    return f"| {label} | " + " | ".join(str(cell(n)) for n in ARMS) + " |"


def markdown(results: dict[str, Any], command: str, meta: dict[str, Any]) -> str:
    lines = ["# The joint strategy on CPU against full checkpointing", "",
             f"`{command}` on {meta['machine']}, torch {meta['torch']}, {meta['threads']} compute thread(s); "
             f"{meta['rounds']} interleaved rounds of {meta['iterations']} iterations per run, the last "
             f"{meta['timed']} of each timed. Budget: {int(FRACTION * 100)} % of the unswapped peak. Peaks: live "
             "tensor bytes between operators (swap.LiveBytesMeter), each run under its own meter.", ""]  # fmt: skip
    for r in results.values():
        lines += section(r)
    return "\n".join(lines)


def section(r: dict[str, Any]) -> list[str]:
    """One workload's part of the results file."""
    mib = 2**20
    c = r["checks"]
    a = c["auto"]
    lines = [f"## {r['workload']}", "",
             f"Unswapped peak {r['unswapped_peak_bytes'] / mib:.1f} MiB, budget {r['budget_bytes'] / mib:.1f} MiB.",
             "", _row("", lambda n: LABELS[n]), "|---" * (len(ARMS) + 1) + "|",
             _row("bitwise equal to plain training", lambda n: c[n]["bitwise_equal"]),
             _row("peak, largest iteration", lambda n: f"{c[n]['peak_bytes'] / mib:.1f} MiB"),
             _row("every iteration within budget", lambda n: c[n]["within_budget"]),
             _row("median step, wall", lambda n: f"{r['median_wall_seconds'][n] * 1e3:.0f} ms"),
             _row("median step, CPU of the process", lambda n: f"{r['median_cpu_seconds'][n] * 1e3:.0f} ms"),
             _row("recompute plan", lambda n: c[n].get("plan", "every block, by hand" if n == "checkpoint" else "-")),
             "",
             f"**Step time ratio auto / full checkpointing by hand: {r['ratio_wall']:.3f} (wall), "
             f"{r['ratio_cpu']:.3f} (CPU)**; per round (wall): {', '.join(f'{x:.3f}' for x in r['round_ratios'])}; "
             f"auto / checkpointing + window: {r['ratio_wall_vs_checkpoint_window']:.3f} (wall). Target: "
             "auto <= hand checkpointing: " + ("met." if r["ratio_wall"] <= 1 else
                                                        f"missed by {(r['ratio_wall'] - 1) * 100:.0f} % (wall)."), "",
             f"auto's plan in the checked run: {a['plan']}; status {a['status']}, steps over budget {a['overruns']}. "
             f"Its plans in the timed runs (each profiles its own): {_counts(r['timed_runs']['auto'])}.", "",
             "| module | kept | swapped | recomputed | rerun s (run) |", "|---|---:|---:|---:|---:|"]  # fmt: skip
    for m in a["modules"]:
        lines.append(f"| {m['module']} | {m['kept_bytes'] / mib:.2f} MiB | {m['swapped_bytes'] / mib:.2f} MiB | "
                     f"{m['recomputed_bytes'] / mib:.2f} MiB | {m['recompute_seconds']:.3f} |")  # fmt: skip
    lines += [""] + [f"- cannot be recomputed: {o['module']}: {o['operator']} x{o['count']} ({o['why']})"
                     for o in a["not_recomputable"]]  # fmt: skip
    lines += [f"- never checkpointed: {p}: {why}" for p, why in a["not_checkpointed"].items()]
    lines += [f"- note: {n}" for n in a["notes"]] + [f"- warning: {x}" for x in a["warnings"]]
    return lines + ["", "What dominates: " + dominates(r), ""]


def plot(results: dict[str, Any], path: Path) -> None:
    """Per workload, the distribution of every timed step of each arm (wall ms)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False)
    for ax, (key, r) in zip(axes[0], results.items()):
        data = [[t * 1e3 for rnd in r["times"][n] for t in rnd] for n in ARMS]
        ax.boxplot(data, showfliers=True)
        ax.set_xticks(range(1, len(ARMS) + 1), [TICKS[n] for n in ARMS], fontsize=8)
        ax.set_title(f"{key}: auto / hand checkpointing = {r['ratio_wall']:.2f} (medians)")
        ax.set_ylabel("step, wall ms")
    save(fig, path)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round of fewer iterations (a smoke run)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch compute threads")
    ap.add_argument("--models", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--render", action="store_true", help="rewrite the .md and .png from <out>/joint_cpu.json only")
    args = ap.parse_args(argv)
    if args.render:
        saved = json.loads((args.out / "joint_cpu.json").read_text())
        write(saved["results"], saved["command"], saved["meta"], args.out, rewrite_json=False)
        return 0
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    torch.set_num_threads(args.threads)
    rounds, iterations, timed = (1, 7, 2) if args.quick else (args.rounds, 10, 5)
    results = {k: measure(k, WORKLOADS[k], rounds, iterations, timed) for k in args.models}
    for key, r in results.items():
        a = r["checks"]["auto"]
        print(f"{key}: auto / full checkpointing step time = {r['ratio_wall']:.3f} (wall), {r['ratio_cpu']:.3f} (CPU); "
              f"bitwise {a['bitwise_equal']}, within budget {a['within_budget']}")  # fmt: skip
    command = "python -m bench.joint_cpu" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    meta = {"machine": platform.machine(), "torch": torch.__version__, "threads": args.threads, "rounds": rounds,
            "iterations": iterations, "timed": timed}  # fmt: skip
    write(results, command, meta, args.out)
    return 0


def write(results: dict[str, Any], command: str, meta: dict[str, Any], out: Path, rewrite_json: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if rewrite_json:
        (out / "joint_cpu.json").write_text(json.dumps({"command": command, "meta": meta, "results": results},
                                                       indent=1, default=str) + "\n")  # fmt: skip
    (out / "joint_cpu.md").write_text(markdown(results, command, meta))
    plot(results, out / "joint_cpu.png")


if __name__ == "__main__":
    sys.exit(main())
