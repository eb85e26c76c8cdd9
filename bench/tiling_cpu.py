"""Tiled execution on CPU, for real: a VGG-style CNN at batch 1 under a tenth of its untiled peak, and the
largest image under a fixed budget against ``checkpoint_sequential`` at its best segment count.

    python -m bench.tiling_cpu            # the sweep and the comparison (1 to 5 minutes on 2 shared cores)
    python -m bench.tiling_cpu --quick    # a smoke run

Part 1, the sweep: per image side, the untiled step's peak (``swap.LiveBytesMeter``, live tensor bytes
between operators, Note [What the meter cannot see]), then ``swap.tiled(model, budget=peak / 10)``: its
measured peak, the planner's prediction, its plan, and the step-time ratio tiled / untiled (CPU time of the
process, Note [CPU time, not wall time] in bench/swap_overhead.py; untiled and tiled steps interleaved, the
median ratio over the rounds). The gradients of every tiled step are checked against the untiled ones
(Note [Tiled gradient tolerance] in tests/swap/tiling/test_tiled_spatial.py).

Part 2, the largest image under a fixed budget: for ``checkpoint_sequential`` over the network's layers with
k = 1..8 segments (on a twin with out-of-place ReLUs, which checkpoint_sequential needs), and for
PyTorch-Base (no checkpoint), the largest side (a multiple of 16) whose measured peak stays within the
budget (bisection on real steps); for ``swap.tiled``, the largest side the planner accepts, verified by one
real step whose measured peak must hold the budget.

Writes <out>/tiling_cpu.json, tiling_cpu.md and tiling_cpu.png.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

import swap
from swap.tiling.plan.largest import largest_side
from swap.units import fmt_bytes, parse_size

from .plotting import pyplot, save

OUT = Path(__file__).parent / "results"


def tolerance(side: int) -> float:
    """Note [Tiled gradient tolerance] (float32): a weight gradient sums over side² positions in another order;
    its rounding error grows like sqrt(side²) · 2^-24, with a margin of 4."""
    return max(2e-5, 4 * side * 2.0**-24)


def log(msg: str) -> None:
    print(f"[tiling_cpu] {msg}", file=sys.stderr, flush=True)


def vgg_style(c: int = 16, blocks: tuple[int, ...] = (2, 2, 3), classes: int = 10) -> nn.Sequential:
    """Blocks of 3x3 convolutions + ReLU closed by 2x2 max pooling, then global pooling and a linear layer:
    one flat nn.Sequential, so that checkpoint_sequential can cut it anywhere."""
    layers: list[nn.Module] = []
    cin = 3
    for k, n in enumerate(blocks):
        for _ in range(n):
            layers += [nn.Conv2d(cin, c * 2**k, 3, padding=1), nn.ReLU(inplace=True)]
            cin = c * 2**k
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


def peak_of(step: Callable[[], None], held: list[torch.Tensor]) -> int:
    """Measured peak live bytes of ``step()``, counting what it holds from before (parameters, input)."""
    with swap.LiveBytesMeter() as meter:
        meter.track(held)
        step()
    return meter.peak


def train_step(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> None:
    F.cross_entropy(model(x), y).backward()


def cpu_seconds(fn: Callable[[], None]) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def sweep(sides: list[int], rounds: int, c: int) -> list[dict]:
    return [sweep_one(side, rounds, c) for side in sides]


def sweep_one(side: int, rounds: int, c: int) -> dict:
    torch.manual_seed(0)
    model = vgg_style(c)
    params = list(model.parameters())
    x, y = torch.randn(1, 3, side, side), torch.tensor([1])
    untiled = peak_of(lambda: train_step(model, x, y), [*params, x])
    ref = [p.grad.clone() for p in params]
    held = sum(r.numel() * r.element_size() for r in ref)
    budget = untiled // 10
    tiled = swap.tiled(model, budget=budget, extra=held)  # the reference gradients stay live: tell it
    model.zero_grad(set_to_none=True)
    peak = peak_of(lambda: train_step(tiled, x, y), [*params, x, *ref])
    err = max(((p.grad - r).abs().max() / r.abs().max()).item() for p, r in zip(params, ref))
    plan = tiled.last_plan
    ratios, times_u, times_t = [], [], []
    for _ in range(rounds):  # interleaved: the machine's load hits both alike
        model.zero_grad(set_to_none=True)
        tu = cpu_seconds(lambda: train_step(model, x, y))
        model.zero_grad(set_to_none=True)
        tt = cpu_seconds(lambda: train_step(tiled, x, y))
        ratios.append(tt / tu)
        times_u.append(tu)
        times_t.append(tt)
    graph = tiled.plan_for(x)[1].graph
    row = dict(side=side, untiled_peak=untiled, budget=budget, tiled_peak=peak, predicted_peak=plan.peak,
               held_within_budget=peak <= budget, plan=plan.describe(graph), grad_rel_error=err,
               untiled_cpu_s=statistics.median(times_u), tiled_cpu_s=statistics.median(times_t),
               ratio_median=statistics.median(ratios), ratios=ratios, tolerance=tolerance(side))  # fmt: skip
    log(f"{side}x{side}: untiled peak {fmt_bytes(untiled)}, tiled {fmt_bytes(peak)} (budget {fmt_bytes(budget)}), "
        f"time x{row['ratio_median']:.2f}, gradient error {err:.1e}; {row['plan']}")  # fmt: skip
    assert err <= tolerance(side), f"tiled gradients off by {err} at {side} (tolerance {tolerance(side)})"
    return row


def compare(budget: int, c: int, max_segments: int) -> dict:
    torch.manual_seed(0)
    model = vgg_style(c)
    params = list(model.parameters())
    y = torch.tensor([1])

    # checkpoint_sequential recomputes a segment from its input, which an in-place ReLU opening the next
    # segment would have overwritten: its twin has out-of-place ReLUs (same parameters)
    twin = copy.deepcopy(model)
    for m in twin.modules():
        if isinstance(m, nn.ReLU):
            m.inplace = False

    def measured(side: int, segments: Optional[int]) -> int:
        x = torch.randn(1, 3, side, side, requires_grad=segments is not None)  # checkpoint needs a grad input
        run = model if segments is None else (lambda t: checkpoint_sequential(twin, segments, t, use_reentrant=False))
        held = [*params, x] if segments is None else [*twin.parameters(), x]
        model.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)
        return peak_of(lambda: train_step(run, x, y), held)

    found: dict[str, int] = {}
    found["pytorch-base"] = largest_side(lambda s: measured(s, None) <= budget, 16, start=32)
    log(f"PyTorch-Base: {found['pytorch-base']}")
    for k in range(1, max_segments + 1):
        found[f"checkpoint_sequential k={k}"] = largest_side(lambda s, k=k: measured(s, k) <= budget, 16, start=32)
        log(f"checkpoint_sequential k={k}: {found[f'checkpoint_sequential k={k}']}")
    best_k = max((k for k in found if k.startswith("checkpoint")), key=lambda k: found[k])

    def planned(side: int) -> bool:
        try:
            swap.tiled(model, budget=budget).plan_for(torch.empty(1, 3, side, side))
            return True
        except swap.TilingInfeasible:
            return False

    tiled_side = largest_side(planned, 16, start=64)
    x = torch.randn(1, 3, tiled_side, tiled_side)
    tiled = swap.tiled(model, budget=budget)
    model.zero_grad(set_to_none=True)
    # The plan of the measured step: asked after it, the module would plan again for the gradients the step
    # left (Note [What the step holds besides the graph]), which a loop frees with zero_grad before the next.
    plan, analysis = tiled.plan_for(x)
    log(f"swap.tiled: planned up to {tiled_side}; verifying with a real step")
    peak = peak_of(lambda: train_step(tiled, x, y), [*params, x])
    return dict(budget=budget, sides=found, best_checkpoint=best_k, best_checkpoint_side=found[best_k],
                tiled_side=tiled_side, tiled_measured_peak=peak, tiled_held=peak <= budget,
                tiled_plan=plan.describe(analysis.graph),
                pixel_ratio_vs_checkpoint=(tiled_side / found[best_k]) ** 2 if found[best_k] else None)  # fmt: skip


def plot(rows: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    sides = [r["side"] for r in rows]
    a.plot(sides, [r["untiled_peak"] / 2**20 for r in rows], "o-", label="untiled (PyTorch)")
    a.plot(sides, [r["tiled_peak"] / 2**20 for r in rows], "s-", label="swap.tiled, measured")
    a.plot(sides, [r["budget"] / 2**20 for r in rows], "k--", label="budget (untiled / 10)")
    a.set(xlabel="image side (pixels)", ylabel="peak live MiB (LiveBytesMeter)", title="Peak, batch 1")
    a.legend()
    b.plot(sides, [r["untiled_cpu_s"] for r in rows], "o-", label="untiled")
    b.plot(sides, [r["tiled_cpu_s"] for r in rows], "s-", label="swap.tiled (budget untiled / 10)")
    b.set(xlabel="image side (pixels)", ylabel="CPU seconds per step (median)", title="Step time on CPU")
    b.legend()
    return save(fig, path)


def markdown(res: dict, cmd: str) -> str:
    lines = ["# Tiled execution on CPU (segmented fused tiling), real runs", "", f"Command: `{cmd}`", "",
             f"Model: VGG-style, {res['channels']} channels in the first block, blocks (2, 2, 3), batch 1, float32. "
             "Peaks are live tensor bytes between operators (swap.LiveBytesMeter); times are CPU seconds of the "
             "process (medians; ratio = median of interleaved tiled/untiled pairs).", "",
             "## Under a tenth of the untiled peak", "",
             "| image | untiled peak | budget | tiled peak (measured) | predicted | time ratio | grad error | plan |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res["sweep"]:
        lines.append(f"| {r['side']}² | {fmt_bytes(r['untiled_peak'])} | {fmt_bytes(r['budget'])} | "
                     f"{fmt_bytes(r['tiled_peak'])} | {fmt_bytes(r['predicted_peak'])} | x{r['ratio_median']:.2f} | "
                     f"{r['grad_rel_error']:.1e} | {r['plan']} |")  # fmt: skip
    c = res["compare"]
    lines += ["", f"## Largest image under {fmt_bytes(c['budget'])}", "", "| strategy | largest side |", "|---|---|"]
    for k, v in c["sides"].items():
        lines.append(f"| {k} | {v}² |")
    lines.append(f"| swap.tiled (measured peak {fmt_bytes(c['tiled_measured_peak'])}) | {c['tiled_side']}² |")
    ratio = c["pixel_ratio_vs_checkpoint"]
    lines += ["", f"swap.tiled reaches {c['tiled_side']}² against {c['best_checkpoint_side']}² for the best "
              f"checkpoint_sequential ({c['best_checkpoint']}): {ratio:.1f}x the pixels.", "",
              f"Plan: {c['tiled_plan']}.", ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one size, one round, 3 checkpoint segment counts")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--budget", default=None, help="the fixed budget of part 2 (default 8MiB, 4MiB with --quick)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # one core: less noise from the machine's other work
    c = 16
    sides = [512] if args.quick else [512, 640, 768]
    rounds = 1 if args.quick else 2
    res = {"channels": c, "sweep": sweep(sides, rounds, c)}
    budget = args.budget or ("4MiB" if args.quick else "8MiB")
    res["compare"] = compare(parse_size(budget, "--budget"), c, 3 if args.quick else 8)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python -m bench.tiling_cpu" + (" --quick" if args.quick else "")
    (out / "tiling_cpu.json").write_text(json.dumps({"command": cmd, **res}, indent=1) + "\n")
    (out / "tiling_cpu.md").write_text(markdown(res, cmd))
    log(f"wrote {plot(res['sweep'], out / 'tiling_cpu.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
