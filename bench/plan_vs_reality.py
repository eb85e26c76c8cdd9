"""The planner's predicted peak against the peak of real training, on CPU, for models nobody here wrote.

    python -m bench.plan_vs_reality            # three models, ~3 minutes on a 2-core VM
    python -m bench.plan_vs_reality --quick    # GPT-2 only, smaller

Models (third-party code, small configurations so CPU training takes seconds):

- a Hugging Face transformer: ``GPT2LMHeadModel`` (4 layers, 256 wide, 256 tokens), labels in the batch;
- a CNN from a library: Hugging Face ``ResNetForImageClassification`` (timm and torchvision do not load
  with this CPU torch build: their compiled operators fail, so the CNN comes from transformers);
- a U-Net: diffusers' ``UNet2DModel`` (the denoising U-Net of DDPM, with attention blocks), trained on the
  noise-prediction loss.

For each, the training step is captured on the meta device mirroring the CPU's kernels
(``swap.forecast.predict_peak(target="cpu")``), and the model is trained for real on the CPU twice: without
swapping, and under ``swap.SwapManager`` with a budget halfway between the least any schedule needs and the
peak without swapping. An independent ``swap.LiveBytesMeter`` measures live tensor bytes in both runs. The
errors are (predicted - measured) / measured: the no-swap peak, and the peak under the budget, over the
planned iterations (after the runtime's two profiling iterations) and over the whole run.

Writes bench/results/plan_vs_reality.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

import swap
from swap.forecast import predict_peak

ROOT = Path(__file__).resolve().parents[1]
KiB, MiB = 1 << 10, 1 << 20
MIN_BYTES = 64 * KiB
ITERATIONS = 5  # two profiling iterations, then planned ones


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the models ---------------------------------------------------------------------------------------------
def gpt2(quick: bool = False) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    seq, vocab = (128, 2048) if quick else (256, 8192)
    cfg = GPT2Config(n_layer=2 if quick else 4, n_embd=128 if quick else 256, n_head=4, n_positions=seq,
                     vocab_size=vocab)  # fmt: skip

    def batch_fn(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (n, seq))
        return {"input_ids": ids, "labels": ids}

    return {"name": "gpt2 (transformers GPT2LMHeadModel)", "model_fn": lambda: GPT2LMHeadModel(cfg),
            "batch_fn": batch_fn, "loss_fn": None, "batch": 4 if quick else 8,
            "config": f"{cfg.n_layer} layers, {cfg.n_embd} wide, {seq} tokens, vocabulary {vocab}"}  # fmt: skip


def resnet() -> dict[str, Any]:
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(embedding_size=32, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2],
                       layer_type="bottleneck", num_labels=100)  # fmt: skip

    def batch_fn(n: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.randn(n, 3, 96, 96), "labels": torch.randint(0, 100, (n,))}

    return {"name": "resnet (transformers ResNetForImageClassification)",
            "model_fn": lambda: ResNetForImageClassification(cfg), "batch_fn": batch_fn, "loss_fn": None,
            "batch": 16, "config": "bottleneck, depths 2-2-2-2, widths 64-512, 96x96 images, 100 classes"}  # fmt: skip


def unet() -> dict[str, Any]:
    from diffusers import UNet2DModel

    def model_fn() -> torch.nn.Module:
        return UNet2DModel(sample_size=64, in_channels=3, out_channels=3, layers_per_block=1,
                           block_out_channels=(32, 64, 128), norm_num_groups=8,
                           down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
                           up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"))  # fmt: skip

    def batch_fn(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, 64, 64), torch.randint(0, 1000, (n,)), torch.randn(n, 3, 64, 64)

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        noisy, t, noise = batch
        return F.mse_loss(model(noisy, t).sample, noise)

    return {"name": "unet (diffusers UNet2DModel)", "model_fn": model_fn, "batch_fn": batch_fn, "loss_fn": loss_fn,
            "batch": 8, "config": "3 levels 32-64-128, attention at the middle level, 64x64 images"}  # fmt: skip


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


# -- a real run ---------------------------------------------------------------------------------------------
def train(spec: dict[str, Any], manager: Optional[swap.SwapManager]) -> dict[str, Any]:
    """Trains ITERATIONS steps on the CPU; the meter's peak over all of them and over the planned ones."""
    torch.manual_seed(0)
    model = spec["model_fn"]().train()
    opt = optimizer(model.parameters())
    loss_fn: Callable[..., torch.Tensor] = spec["loss_fn"] or swap.capture.default_loss
    meter = swap.LiveBytesMeter("cpu")
    peaks, losses, t0 = [], [], time.perf_counter()
    with meter.track_existing():
        if manager is not None:
            manager.__enter__()
        try:
            for _ in range(ITERATIONS):
                meter.reset_peak()
                data = spec["batch_fn"](spec["batch"])
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model, data)
                loss.backward()
                opt.step()
                losses.append(loss.item())
                del data, loss
                peaks.append(meter.peak)
        finally:
            if manager is not None:
                manager.__exit__(None, None, None)
    return {"peak": max(peaks), "planned_peak": max(peaks[2:]), "per_iteration": peaks, "losses": losses,
            "seconds": time.perf_counter() - t0}  # fmt: skip


def error(predicted: int, measured: int) -> float:
    return (predicted - measured) / measured


def evaluate(spec: dict[str, Any]) -> dict[str, Any]:
    common = dict(batch=spec["batch"], optimizer=optimizer, min_bytes=MIN_BYTES, target="cpu")
    t0 = time.perf_counter()
    free = predict_peak(spec["model_fn"], spec["batch_fn"], spec["loss_fn"], **common)
    budget = free.floor + (free.no_swap_peak - free.floor) // 2
    under = predict_peak(spec["model_fn"], spec["batch_fn"], spec["loss_fn"], budget=budget, **common)
    predict_seconds = time.perf_counter() - t0
    log(f"{spec['name']}: predicted {free.no_swap_peak / MiB:.1f} MiB without swapping, {under.planned_peak / MiB:.1f}"
        f" MiB under a budget of {budget / MiB:.1f} MiB ({predict_seconds:.1f} s); training...")  # fmt: skip
    plain = train(spec, None)
    sm = swap.SwapManager(budget=budget, device="cpu", min_bytes=MIN_BYTES, policy="window")  # what predict_peak plans
    swapped = train(spec, sm)
    report = sm.report()
    row = {
        "model": spec["name"], "config": spec["config"], "batch": spec["batch"],
        "parameters": sum(p.numel() for p in spec["model_fn"]().parameters()),
        "budget": budget, "floor": free.floor,
        "predicted_no_swap_peak": free.no_swap_peak, "measured_no_swap_peak": plain["peak"],
        "no_swap_error": error(free.no_swap_peak, plain["peak"]),
        "predicted_peak_under_budget": under.planned_peak,
        "measured_peak_under_budget_planned": swapped["planned_peak"],
        "measured_peak_under_budget_all": swapped["peak"],
        "error_under_budget_planned": error(under.planned_peak, swapped["planned_peak"]),
        "error_under_budget_all": error(under.planned_peak, swapped["peak"]),
        "predicted_swapped_bytes_per_step": under.swapped_bytes,
        "runtime_swapped_out_bytes": report["swapped_out_bytes"], "runtime_iterations": report["iterations"],
        "runtime_planned_peak": report["planned_peak_bytes"], "runtime_declined": report["declined"],
        "losses_equal": plain["losses"] == swapped["losses"],
        "per_iteration_no_swap": plain["per_iteration"], "per_iteration_swapped": swapped["per_iteration"],
        "predict_seconds": predict_seconds, "train_seconds": plain["seconds"] + swapped["seconds"],
    }  # fmt: skip
    log(f"  measured {plain['peak'] / MiB:.1f} MiB without swapping ({row['no_swap_error']:+.2%}), "
        f"{swapped['planned_peak'] / MiB:.1f} MiB under the budget ({row['error_under_budget_planned']:+.2%})")
    return row


def markdown(results: dict[str, Any]) -> str:
    m = results["meta"]
    lines = [
        f"Command: `{m['command']}` ({m['date']}, torch {m['torch']}, {m['machine']}).",
        "",
        "Peak live tensor bytes of real CPU training (an independent `swap.LiveBytesMeter`) against the planner's "
        "prediction from a meta-device capture (`swap.forecast.predict_peak(target=\"cpu\")`). Under the budget: "
        "`swap.SwapManager(budget, min_bytes=64KiB)`, window policy; 'planned' is the iterations after the "
        "runtime's two profiling iterations, 'all' includes them. Error = (predicted - measured) / measured.",
        "",
        "| model | batch | params | no swap: predicted / measured (MiB) | error | budget (MiB) | under budget: "
        "predicted / planned iters / all iters (MiB) | error (planned) | error (all) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["models"]:
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['parameters'] / 1e6:.1f} M "
            f"| {r['predicted_no_swap_peak'] / MiB:.2f} / {r['measured_no_swap_peak'] / MiB:.2f} "
            f"| {r['no_swap_error']:+.2%} | {r['budget'] / MiB:.2f} "
            f"| {r['predicted_peak_under_budget'] / MiB:.2f} / {r['measured_peak_under_budget_planned'] / MiB:.2f} / "
            f"{r['measured_peak_under_budget_all'] / MiB:.2f} | {r['error_under_budget_planned']:+.2%} "
            f"| {r['error_under_budget_all']:+.2%} |"
        )
    lines += ["", "Configurations:", ""] + [f"- {r['model']}: {r['config']}" for r in results["models"]]
    lines += ["", f"Worst absolute error: no swap {results['worst']['no_swap']:.2%}, under the budget (planned "
              f"iterations) {results['worst']['under_budget_planned']:.2%}, (all iterations) "
              f"{results['worst']['under_budget_all']:.2%}."]  # fmt: skip
    lines += ["", "Step times, predicted against measured for the same models: bench/results/plan_vs_reality_time.md "
              "(`python -m bench.plan_vs_reality_time`)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plan_vs_reality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="GPT-2 only, smaller")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    specs = [gpt2(quick=True)] if args.quick else [gpt2(), resnet(), unet()]
    t0 = time.perf_counter()
    rows = [evaluate(s) for s in specs]
    results = {
        "meta": {"command": "python -m bench.plan_vs_reality" + (" --quick" if args.quick else ""),
                 "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "python": platform.python_version(),
                 "machine": platform.machine(), "iterations": ITERATIONS, "min_bytes": MIN_BYTES,
                 "seconds": 0.0},  # fmt: skip
        "models": rows,
        "worst": {
            "no_swap": max(abs(r["no_swap_error"]) for r in rows),
            "under_budget_planned": max(abs(r["error_under_budget_planned"]) for r in rows),
            "under_budget_all": max(abs(r["error_under_budget_all"]) for r in rows),
        },
    }
    results["meta"]["seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_vs_reality.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "plan_vs_reality.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
