"""Every keep / swap / recompute strategy side by side, simulated on H100 and on the window-scheduling
paper's V100.

    python -m bench.strategies                 # writes bench/results/strategies.{md,json,png}
    python -m bench.strategies --only resnet50-v100

Per workload, ``swap.plan`` captures the training step on the meta device and compares every baseline of
``swap.joint.search`` and the joint strategy ("auto") on the device profile (Note [Strategies from one
capture]): samples/s at 1x, 2x, 3x, 5x and 10x the largest batch that fits without swapping, and each
strategy's largest batch. Then the strategy targets are checked (``bench.strategy_targets``); a missed one
says by how much and why: the wall's largest tensors (which operator, which module), what the link and the
recompute cost there. Simulated, not measured: the figures are the planner's, on the datasheet roofline.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import swap
from swap.forecast import zoo
from swap.forecast.strategies import MULTIPLES

from .plotting import pyplot, save
from .strategy_targets import WORKLOADS, Workload, check, kept, largest_tensors

RESULTS = Path(__file__).resolve().parent / "results"


def hf_gpt2_medium() -> torch.nn.Module:
    """Hugging Face's GPT2LMHeadModel with GPT-2 medium's configuration, attention through SDPA as shipped."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=1024, vocab_size=50257, use_cache=False,
                     attn_implementation="sdpa")  # fmt: skip
    return GPT2LMHeadModel(cfg)


def hf_batch(n: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 50257, (n, 1024))
    return {"input_ids": ids, "labels": ids}


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _build(w: Workload) -> dict[str, Any]:
    """``swap.plan``'s arguments for a workload."""
    if w.model == "hf-gpt2-medium":
        return {"model_fn": hf_gpt2_medium, "batch_fn": hf_batch, "optimizer": adamw, "dtype": torch.bfloat16}
    z = zoo.ZOO[w.model]
    return {"model_fn": z.model_fn(), "batch_fn": z.batch_fn(), "optimizer": adamw if w.optimizer == "adamw" else sgd,
            "dtype": z.dtype}  # fmt: skip


def run(w: Workload) -> dict[str, Any]:
    args = _build(w)
    t0 = time.perf_counter()
    p = swap.plan(args["model_fn"], args["batch_fn"], budget=w.budget, device=w.device, allocator=None,
                  optimizer=args["optimizer"], dtype=args["dtype"], policies=("none",), name=w.name)  # fmt: skip
    seconds = time.perf_counter() - t0
    s = p.strategies
    wall = largest_tensors(args, s["auto"].max_batch + 1) if s["auto"].max_batch else []
    checks = check(w, s, wall)
    return {"workload": asdict(w), "device": p.device.name, "seconds": seconds, "strategies": s, "checks": checks,
            "wall": wall}  # fmt: skip


def _speed(r: Any, n: int) -> str:
    p = r.at(n)
    return f"{p.samples_per_s:.4g}" if p is not None and p.fits else "-"


def markdown(runs: list[dict[str, Any]], command: str) -> str:
    out = ["# Every strategy side by side (simulated)", "",
           "Simulated by `swap.plan` on the device profiles' datasheet figures (roofline per "
           "operator, host link, ideal allocator), from captures on the meta device: no GPU ran these. "
           "`kept` is samples/s over the no-swap samples/s at its largest batch (1x).", "",
           f"Command: `{command}`", ""]  # fmt: skip
    for run_ in runs:
        w, s = run_["workload"], run_["strategies"]
        plain = s["none"].max_batch
        batches = [k * plain for k in MULTIPLES]
        out += [f"## {w['name']} on {run_['device']}, budget {w['budget']}", "",
                f"No-swap batch (1x): {plain}. Planned in {run_['seconds']:.0f} s.", "",
                "| strategy | " + " | ".join(f"{k}x ({n})" for k, n in zip(MULTIPLES, batches))
                + " | largest batch | samples/s there (kept) | plan at the largest batch |",
                "|---|" + "---|" * (len(batches) + 3)]  # fmt: skip
        for name, r in s.items():
            top = r.at_max
            fits = top is not None and top.fits
            there = f"{top.samples_per_s:.4g} ({kept(s, r.max_batch, name):.0%})" if fits else "-"
            mult = f"{r.max_batch / plain:.1f}x" if plain else ""
            bold = "**" if name == "auto" else ""
            out.append(f"| {bold}{name}{bold} | " + " | ".join(_speed(r, n) for n in batches)
                       + f" | {r.max_batch} ({mult}) | {there} | {top.plan if top is not None else ''} |")  # fmt: skip
        out += ["", "Targets:", ""]
        out += [f"- {'met' if c['met'] else '**missed**'}: {c['target']}: {c['detail']}" for c in run_["checks"]]
        auto = s["auto"]
        out += ["", f"Past the joint strategy's largest batch ({auto.max_batch}): {auto.blocker}"]
        if run_["wall"]:
            out += ["", f"Largest tensors of one step at batch {auto.max_batch + 1}:", ""]
            out += [f"- {t['bytes'] / 2**30:.2f} GiB: {t['op']} in {t['module'] or '(outside modules: the loss)'}"
                    for t in run_["wall"]]  # fmt: skip
        out.append("")
    return "\n".join(out)


def plot(runs: list[dict[str, Any]], path: Path) -> Path:
    from swap.forecast.strategy_report import draw

    plt = pyplot()
    cols = min(2, len(runs))
    rows = (len(runs) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.8 * rows), squeeze=False)
    for ax, run_ in zip(axes.flat, runs):
        w = run_["workload"]
        draw(ax, run_["strategies"], f"{w['name']}\n{run_['device']}, budget {w['budget']} (simulated)")
    for ax in list(axes.flat)[len(runs) :]:
        ax.set_visible(False)
    axes[0][0].legend(fontsize=7, ncol=2)
    return save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.strategies", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--only", default=None, help=f"one workload: {', '.join(w.key for w in WORKLOADS)}")
    ap.add_argument("--out", default=str(RESULTS / "strategies"), help="path prefix of the .md, .json and .png")
    args = ap.parse_args(argv)
    chosen = [w for w in WORKLOADS if args.only in (None, w.key)]
    if not chosen:
        ap.error(f"unknown workload {args.only!r}: choose one of {', '.join(w.key for w in WORKLOADS)}")
    runs = []
    for w in chosen:
        print(f"== {w.name} on {w.device}", file=sys.stderr, flush=True)
        runs.append(run(w))
    command = "python -m bench.strategies" + (f" --only {args.only}" if args.only else "")
    out = Path(args.out)
    out.with_suffix(".md").write_text(markdown(runs, command))
    data = [{**r, "strategies": {k: asdict(v) for k, v in r["strategies"].items()}} for r in runs]
    out.with_suffix(".json").write_text(json.dumps({"command": command, "runs": data}, indent=1) + "\n")
    print(f"wrote {out.with_suffix('.md')}, {out.with_suffix('.json')}, {plot(runs, out.with_suffix('.png'))}")
    for r in runs:
        for c in r["checks"]:
            print(f"{r['workload']['key']}: {'met' if c['met'] else 'MISSED'}: {c['target']}: {c['detail']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
