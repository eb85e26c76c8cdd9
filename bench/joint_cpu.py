"""The joint policy measured for real on CPU (issue 17, item 5): HF GPT-2 (4 layers) and a ResNet at a budget of
40 % of the unswapped peak, against full checkpointing by hand.

    python -m bench.joint_cpu            # both models, 3 rounds (about ten minutes on 2 shared cores)
    python -m bench.joint_cpu --quick    # one round, fewer iterations: a smoke run

Per model:
1. ``plain``: training without manager or checkpointing, under a LiveBytesMeter: the reference losses and
   parameters, and the unswapped peak; the budget is 40 % of it.
2. ``check``: ``SwapManager(budget, policy="auto")`` under an independent LiveBytesMeter: bitwise equal to
   plain (losses, parameters, buffers) and every iteration within the budget, the profiling ones included.
   Full checkpointing by hand (every transformer layer / bottleneck in ``torch.utils.checkpoint``, no manager)
   is run under a meter too: its peak says whether it meets the budget on its own.
3. ``timing``: rounds of one auto run and one hand-checkpointed run, interleaved (auto, checkpoint, auto, ...),
   each a fresh model trained for the same iterations; the iterations after the manager has planned are timed
   (wall clock and CPU time of the process, the copy threads included), and the ratio is the median of auto's
   over the median of checkpointing's.

One compute thread (``--threads``): the copy workers then have the second core, as a GPU's copy engines do not
compete with its kernels; the machine is shared with other work, hence the interleaving and medians.

Writes <out>/joint_cpu.json, joint_cpu.md and joint_cpu.png.
"""

from __future__ import annotations

import argparse
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
from torch.utils.checkpoint import checkpoint

import swap
from bench import models
from bench.plotting import pyplot, save

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.joint_cpu")
FRACTION = 0.4


class Workload:
    """A model, its batches, its optimizer and its blocks (what hand checkpointing wraps)."""

    def __init__(self, name: str, build: Callable[[], torch.nn.Module], batch: Callable[[int], Any],
                 loss: Callable[[torch.nn.Module, Any], torch.Tensor], blocks: Callable[[torch.nn.Module], list],
                 optimizer: Callable[[Any], torch.optim.Optimizer]) -> None:  # fmt: skip
        self.name, self.build, self.batch, self.loss, self.blocks, self.optimizer = (
            name, build, batch, loss, blocks, optimizer)  # fmt: skip


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128, vocab_size=1024, bos_token_id=0,
                     eos_token_id=0, use_cache=False)  # the cache is off when training with checkpointing  # fmt: skip
    return GPT2LMHeadModel(cfg)


def resnet() -> torch.nn.Module:
    torch.manual_seed(0)
    return models.resnet((1, 1, 1, 1), width=16, num_classes=10)


def _tokens(it: int) -> torch.Tensor:
    return torch.randint(0, 1024, (8, 128), generator=torch.Generator().manual_seed(it))


def _images(it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(it)
    return torch.randn(16, 3, 64, 64, generator=g), torch.randint(0, 10, (16,), generator=g)


WORKLOADS = {
    "gpt2": Workload(
        "HF GPT-2 (4 layers, d=256, seq 128, vocab 1024, batch 8), AdamW", gpt2, _tokens,
        lambda m, x: m(input_ids=x, labels=x).loss, lambda m: list(m.transformer.h),
        lambda p: torch.optim.AdamW(p, lr=1e-4)),
    "resnet": Workload(
        "ResNet (bench.models, bottlenecks 1-1-1-1, width 16, 64x64, batch 16), SGD", resnet, _images,
        lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), lambda m: list(m.blocks),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
}  # fmt: skip


def by_hand(model: torch.nn.Module, blocks: list) -> torch.nn.Module:
    """Full checkpointing as a user writes it: every block's forward in a non-reentrant checkpoint."""
    for block in blocks:
        inner = block.forward
        block.forward = lambda *a, inner=inner, **k: checkpoint(inner, *a, use_reentrant=False, **k)
    return model


def train(w: Workload, iterations: int, context: Optional[Any] = None, meter: Optional[swap.LiveBytesMeter] = None,
          hand: bool = False) -> dict[str, Any]:  # fmt: skip
    """Trains a fresh model; per iteration: loss, wall and CPU seconds, and the meter's peak if given."""
    import contextlib
    import gc

    gc.collect()
    model = w.build()
    if hand:
        by_hand(model, w.blocks(model))
    opt = w.optimizer(model.parameters())
    out: dict[str, Any] = {"losses": [], "wall": [], "cpu": [], "peaks": []}
    with contextlib.ExitStack() as stack:
        if meter is not None:
            stack.enter_context(meter.track_existing())
            meter.reset_window()
        if context is not None:
            stack.enter_context(context)
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
    return out


def bitwise(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


def measure(key: str, w: Workload, rounds: int, iterations: int, timed: int) -> dict[str, Any]:
    log.info("%s: plain run under a meter", key)
    plain = train(w, iterations, meter=swap.LiveBytesMeter("cpu"))
    peak = max(plain["peaks"])
    budget = int(peak * FRACTION)
    log.info("%s: unswapped peak %.1f MiB, budget %.1f MiB; auto under an independent meter", key, peak / 2**20,
             budget / 2**20)  # fmt: skip
    sm = swap.SwapManager(budget=budget, device="cpu", min_bytes="16KiB")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", swap.BudgetWarning)
        check = train(w, iterations, context=sm, meter=swap.LiveBytesMeter("cpu"))
    report = sm.report()
    log.info("%s: hand checkpointing under a meter", key)
    hand = train(w, iterations, meter=swap.LiveBytesMeter("cpu"), hand=True)
    times: dict[str, list[list[float]]] = {"auto": [], "checkpoint": [], "auto_cpu": [], "checkpoint_cpu": []}
    for r in range(rounds):
        for name in ("auto", "checkpoint"):
            log.info("%s: round %d/%d, %s", key, r + 1, rounds, name)
            ctx = swap.SwapManager(budget=budget, device="cpu", min_bytes="16KiB") if name == "auto" else None
            run = train(w, iterations, context=ctx, hand=name == "checkpoint")
            times[name].append(run["wall"][-timed:])
            times[name + "_cpu"].append(run["cpu"][-timed:])
    med = {k: statistics.median([t for rnd in v for t in rnd]) for k, v in times.items()}
    rows = [r for r in report["modules"] if r["kept_bytes"] or r["swapped_bytes"] or r["recomputed_bytes"]]
    return {
        "workload": w.name, "unswapped_peak_bytes": peak, "budget_bytes": budget,
        "auto": {"bitwise_equal": bitwise(plain, check), "peaks": check["peaks"],
                 "within_budget": all(p <= budget for p in check["peaks"]), "status": report["status"],
                 "plan": report["recompute_plan"], "simulated_step_seconds": report["simulated_step_seconds"],
                 "swapped_out_bytes": report["swapped_out_bytes"], "overruns": report["overruns"],
                 "warnings": [str(c.message) for c in caught], "modules": rows, "notes": report["notes"]},
        "checkpoint_by_hand": {"bitwise_equal": bitwise(plain, hand), "peak_bytes": max(hand["peaks"]),
                               "within_budget": max(hand["peaks"]) <= budget},
        "times": times, "median_wall_seconds": {"auto": med["auto"], "checkpoint": med["checkpoint"]},
        "median_cpu_seconds": {"auto": med["auto_cpu"], "checkpoint": med["checkpoint_cpu"]},
        "ratio_wall": med["auto"] / med["checkpoint"], "ratio_cpu": med["auto_cpu"] / med["checkpoint_cpu"],
        "round_ratios": [statistics.median(a) / statistics.median(c) for a, c in zip(times["auto"], times["checkpoint"])],
    }  # fmt: skip


def markdown(results: dict[str, Any], command: str, meta: dict[str, Any]) -> str:
    mib = 2**20
    lines = ["# The joint policy on CPU against full checkpointing", "",
             f"`{command}` on {meta['machine']}, torch {meta['torch']}, {meta['threads']} compute thread(s); "
             f"{meta['rounds']} interleaved rounds of {meta['iterations']} iterations per run, the last "
             f"{meta['timed']} of each timed. Budget: {int(FRACTION * 100)} % of the unswapped peak.", ""]  # fmt: skip
    for key, r in results.items():
        a, h = r["auto"], r["checkpoint_by_hand"]
        lines += [f"## {r['workload']}", "",
                  f"Unswapped peak {r['unswapped_peak_bytes'] / mib:.1f} MiB, budget {r['budget_bytes'] / mib:.1f} MiB.",
                  "", "| | auto (SwapManager) | full checkpointing by hand |", "|---|---|---|",
                  f"| bitwise equal to plain training | {a['bitwise_equal']} | {h['bitwise_equal']} |",
                  f"| peak (LiveBytesMeter), every iteration | {max(a['peaks']) / mib:.1f} MiB, within budget: "
                  f"{a['within_budget']} | {h['peak_bytes'] / mib:.1f} MiB, within budget: {h['within_budget']} |",
                  f"| median step, wall | {r['median_wall_seconds']['auto'] * 1e3:.0f} ms | "
                  f"{r['median_wall_seconds']['checkpoint'] * 1e3:.0f} ms |",
                  f"| median step, CPU of the process | {r['median_cpu_seconds']['auto'] * 1e3:.0f} ms | "
                  f"{r['median_cpu_seconds']['checkpoint'] * 1e3:.0f} ms |", "",
                  f"**Step time ratio auto / checkpointing: {r['ratio_wall']:.3f} (wall), {r['ratio_cpu']:.3f} (CPU)**; "
                  f"per round (wall): {', '.join(f'{x:.3f}' for x in r['round_ratios'])}.", "",
                  f"auto's plan: {a['plan']}, status {a['status']}; {a['swapped_out_bytes'] / mib:.1f} MiB swapped out "
                  f"over the run; steps over budget: {a['overruns']}.", "",
                  "| module | kept | swapped | recomputed | rerun s (run) |", "|---|---:|---:|---:|---:|"]  # fmt: skip
        for m in a["modules"]:
            lines.append(f"| {m['module']} | {m['kept_bytes'] / mib:.2f} MiB | {m['swapped_bytes'] / mib:.2f} MiB | "
                         f"{m['recomputed_bytes'] / mib:.2f} MiB | {m['recompute_seconds']:.3f} |")  # fmt: skip
        lines += [""] + [f"- note: {n}" for n in a["notes"]] + [""]
        lines += ["What dominates: " + r.get("why", "see the notes above."), ""]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), squeeze=False)
    for ax, (key, r) in zip(axes[0], results.items()):
        for name, color in (("auto", "tab:blue"), ("checkpoint", "tab:orange")):
            for k, rnd in enumerate(r["times"][name]):
                ax.plot(range(len(rnd)), [t * 1e3 for t in rnd], "o-", color=color, alpha=0.5 + 0.5 * k / max(1, len(r["times"][name])),
                        label=f"{name}" if k == 0 else None)  # fmt: skip
        ax.set_title(f"{key}: auto / checkpoint = {r['ratio_wall']:.2f}")
        ax.set_xlabel("timed iteration")
        ax.set_ylabel("step, wall ms")
        ax.legend()
    save(fig, path)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round of fewer iterations (a smoke run)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch compute threads")
    ap.add_argument("--models", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    torch.set_num_threads(args.threads)
    rounds, iterations, timed = (1, 6, 2) if args.quick else (args.rounds, 9, 5)
    results = {k: measure(k, WORKLOADS[k], rounds, iterations, timed) for k in args.models}
    for key, r in results.items():
        print(f"{key}: auto / full checkpointing step time = {r['ratio_wall']:.3f} (wall), {r['ratio_cpu']:.3f} (CPU); "
              f"bitwise {r['auto']['bitwise_equal']}, within budget {r['auto']['within_budget']}")  # fmt: skip
    command = "python -m bench.joint_cpu" + (" --quick" if args.quick else "")
    meta = {"machine": platform.machine(), "torch": torch.__version__, "threads": args.threads, "rounds": rounds,
            "iterations": iterations, "timed": timed}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "joint_cpu.json").write_text(json.dumps({"command": command, "meta": meta, "results": results},
                                                        indent=1, default=str) + "\n")  # fmt: skip
    (args.out / "joint_cpu.md").write_text(markdown(results, command, meta))
    plot(results, args.out / "joint_cpu.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
