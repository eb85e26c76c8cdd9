"""One rank of FSDP2, forecast and measured: ``swap.plan(..., world_size=2, shard="fsdp2")``'s per-rank peak
against the peak two gloo ranks on this CPU reach, training the same GPT with ``fully_shard`` on each block and
the root and AdamW (an independent LiveBytesMeter per rank).

    python -m bench.fsdp_cpu            # three shapes (about two minutes on 2 shared cores)
    python -m bench.fsdp_cpu --quick    # one

The target: every shape within 5 % (Note [One rank of FSDP2] in swap/forecast/distributed.py says what the
forecast models). The measured peak is the highest over the ranks and over iterations 2 to 4 (the first has no
optimizer state yet); the forecast's is the planned peak of policy "none" at that batch.

Writes <out>/fsdp_cpu.json and fsdp_cpu.md.
"""

from __future__ import annotations

import argparse
import functools
import gc
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

import swap
from bench.ranks import spawn
from bench.write import write_results
from swap.forecast import zoo

ROOT = Path(__file__).resolve().parents[1]
VOCAB, SEQ = 64, 64
SHAPES = [  # (layers, d_model, batch): parameters and optimizer state from a third to two thirds of the peak
    (4, 256, 2),
    (3, 128, 6),
    (6, 192, 4),
]
TARGET = 0.05


def model_fn(layers: int, d: int) -> torch.nn.Module:
    return zoo.gpt(n_layer=layers, n_head=4, d_model=d, vocab=VOCAB, seq_len=SEQ)


def batch_fn(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, VOCAB, (n, SEQ + 1))
    return t[:, :-1], t[:, 1:]


def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def measure(rank: int, tmp: str, layers: int, d: int, batch: int, iterations: int = 4) -> list[int]:
    """This rank's peak per iteration, training with FSDP2 (a ``bench.ranks.spawn`` worker)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = model_fn(layers, d)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gc.collect()  # the unsharded parameters fully_shard replaced are garbage, not memory of the run
    meter = swap.LiveBytesMeter("cpu").track_existing()
    peaks = []
    with meter:
        meter.reset_window()
        for it in range(iterations):
            torch.manual_seed(100 * rank + it)
            opt.zero_grad()
            loss = loss_fn(model, batch_fn(batch))
            loss.backward()
            opt.step()
            del loss
            peaks.append(meter.reset_window())
    return peaks


def forecast(layers: int, d: int, batch: int) -> int:
    """The per-rank planned peak of ``swap.plan`` at ``batch`` (no swapping)."""
    p = swap.plan(functools.partial(model_fn, layers, d), batch_fn, loss_fn, budget="1GiB", device="h100-pcie",
                  allocator=None, max_batch=batch, policies=("none",), strategies=(), target="cpu",
                  min_bytes=0, world_size=2, shard="fsdp2", progress=False)  # fmt: skip
    r = p.policies["none"]
    if r.max_batch != batch:
        raise RuntimeError(f"the forecast did not reach batch {batch} under 1 GiB")
    return int(r.peak)


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fsdp_cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="the first shape only")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    rows = []
    for layers, d, batch in SHAPES[:1] if args.quick else SHAPES:
        predicted = forecast(layers, d, batch)
        ranks = spawn(functools.partial(measure, layers=layers, d=d, batch=batch))
        measured = max(max(peaks[1:]) for peaks in ranks)
        typical = statistics.median(p for peaks in ranks for p in peaks[1:])
        error = predicted / measured - 1
        rows.append({"layers": layers, "d_model": d, "batch": batch, "seq": SEQ, "vocab": VOCAB,
                     "predicted": predicted, "measured": measured, "median": typical, "per_rank_iteration_peaks": ranks,
                     "error": error, "median_error": predicted / typical - 1,
                     "within_target": abs(error) <= TARGET})  # fmt: skip
        print(f"GPT {layers} x d{d}, batch {batch}: forecast {predicted} B, measured {measured} B ({error:+.3%})")
    lines = [
        "# One rank of FSDP2 on CPU: forecast against measured peak",
        "",
        f"`python -m bench.fsdp_cpu` (2 gloo ranks, torch {torch.__version__}, {platform.machine()}). "
        "GPT (zoo) with `fully_shard` on each block and the root, AdamW; sequence 64, vocabulary 64. Forecast: "
        "`swap.plan(..., world_size=2, shard='fsdp2', target='cpu')`, policy `none`'s planned peak; measured: an "
        "independent `LiveBytesMeter` per rank, the highest over ranks and iterations 2-4. "
        f"Target: within {TARGET:.0%} of the highest. The median iteration is the steady state; the highest adds "
        "what Python's cycle collector had not yet freed in that iteration (it varies run to run).",
        "",
        "| layers | d_model | batch | forecast per rank | measured, highest | error | measured, median | error | "
        "within target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['layers']} | {r['d_model']} | {r['batch']} | {r['predicted'] / 2**20:.2f} MiB | "
                     f"{r['measured'] / 2**20:.2f} MiB | {r['error']:+.3%} | {r['median'] / 2**20:.2f} MiB | "
                     f"{r['median_error']:+.3%} | {'yes' if r['within_target'] else 'NO'} |")
    write_results(Path(args.out), "fsdp_cpu", {"target": TARGET, "shapes": rows}, "\n".join(lines) + "\n")
    return 0 if all(r["within_target"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
