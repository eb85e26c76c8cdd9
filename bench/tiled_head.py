"""The LM head and loss tiled along tokens: GPT-2 medium bf16's largest batch on an H100-SXM 80 GB with and
without it, under a swap policy given as a parameter.

    python -m bench.tiled_head                        # policies none and window (a few minutes)
    python -m bench.tiled_head --policies none,window,fixed_distance,all
    python -m bench.tiled_head --quick                # a smaller budget

At a 50k vocabulary the logits (batch × 1024 tokens × 50257 in bf16), their fp32 copy for the loss and the
loss's buffers are the largest tensors of the step (Note [Tiled head and loss] in
swap/tiling/plan/head.py). Both runs are planned by ``swap.plan`` from a capture of the training step on
the meta device: the baseline is the built-in ``gpt2-medium-bf16``; the tiled run is the same model whose
forward stops at the final LayerNorm, and whose loss is ``swap.tiled_cross_entropy`` in ``--tiles`` tiles of
tokens, so the capture records what the tiled head really allocates and frees. (A fixed number of tiles, not
of tokens per tile, keeps the step's operators the same at every batch, so the planner scales its trace
from small captures; the head's memory is then a fixed fraction of the untiled head's.) A new policy (for example
swap-or-recompute, when it lands) is one more name in ``--policies``. Besides, both steps are captured at
batch 2 to show where the head's products run and what it holds from forward to backward (``head_accounting``).

Writes <out>/tiled_head.json and tiled_head.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

import swap
from swap.capture import OP, PHASE, SAVE, Trace, capture
from swap.forecast.zoo import GPT, ZOO

OUT = Path(__file__).parent / "results"


class Trunk(nn.Module):
    """A ``GPT`` whose forward returns the final hidden states (the head runs in the loss)."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        x = g.tok(idx) + g.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in g.blocks:
            x = block(x)
        return g.ln(x)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def optimizer_of(name: str) -> Callable[[Any], torch.optim.Optimizer]:
    """``adamw`` (the setting of ``bench.strategies``), or else the built-in workload's optimizer (SGD with
    momentum)."""
    return adamw if name == "adamw" else ZOO["gpt2-medium-bf16"].optimizer


def tiled_loss(tiles: int) -> Callable[[Trunk, Any], torch.Tensor]:
    """The mean token loss of a ``Trunk``'s hidden states through its head, in ``tiles`` tiles of tokens."""

    def loss(model: Trunk, batch: Any) -> torch.Tensor:
        x, y = batch
        return swap.tiled_cross_entropy(model(x), model.gpt.head, y, tokens=-(-y.numel() // tiles)) / y.numel()

    return loss


def _step_accounting(t: Trace) -> dict:
    """FLOPs per phase and bytes saved for backward in the last captured iteration."""
    b, e = t.iterations()[-1]
    op, phase, flops = t.op[b : e + 1], t.phase[b : e + 1], t.flops[b : e + 1]
    per_phase = {ph: float(flops[(op == OP) & (phase == PHASE[ph])].sum()) for ph in ("forward", "backward")}
    return {**{f"{ph}_gflop": v / 1e9 for ph, v in per_phase.items()},
            "saved_mib": float(t.size[b : e + 1][op == SAVE].sum()) / 2**20}  # fmt: skip


def head_accounting(tiles: int, batch: int = 2, optimizer: str = "adamw") -> dict:
    """What the capture records for one step at ``batch``, untiled and tiled head: the tiled head's products
    move from backward to forward (backward loses the head's two, 4 · tokens · hidden · vocab FLOPs, and
    recomputes nothing), and what it saves for backward (the hidden states' and the weight's gradients)
    replaces the untiled loss's tokens × vocab tensors."""
    w, opt = ZOO["gpt2-medium-bf16"], optimizer_of(optimizer)
    base = capture(w.model_fn(), w.batch_fn(), batch, optimizer=opt, dtype=w.dtype)
    tiled = capture(lambda: Trunk(w.model_fn()()), w.batch_fn(), batch, tiled_loss(tiles), optimizer=opt,
                    dtype=w.dtype)  # fmt: skip
    with torch.device("meta"):
        head = w.model_fn()().head.weight
    tokens = batch * w.size
    return {"batch": batch, "tokens": tokens, "head_products_gflop": 2 * 2 * tokens * head.numel() / 1e9,
            "grad_hidden_mib": tokens * head.shape[1] * 2 / 2**20, "grad_weight_fp32_mib": head.numel() * 4 / 2**20,
            "untiled_head": _step_accounting(base), "tiled_head": _step_accounting(tiled)}  # fmt: skip


def run(budget: str, device: str, policies: tuple[str, ...], tiles: int, strategies: tuple[str, ...] = (),
        optimizer: str = "adamw") -> dict:  # fmt: skip
    """Plan the built-in GPT-2 medium with and without the tiled head; each swap policy's and each strategy's
    largest batch, and the strategies' samples/s at 5x the untiled model's no-swap batch (where
    the strategies are held to keep most of the no-swap speed)."""
    w = ZOO["gpt2-medium-bf16"]
    common: dict[str, Any] = dict(budget=budget, device=device, policies=policies, optimizer=optimizer_of(optimizer),
                                  dtype=w.dtype, progress=True, strategies=strategies)  # fmt: skip
    base = swap.plan(w.model_fn(), w.batch_fn(), name="gpt2-medium-bf16", **common)
    one = base.max_batch.get("none") or 0
    five = 5 * one if strategies and one else None
    tiled = swap.plan(lambda: Trunk(w.model_fn()()), w.batch_fn(), tiled_loss(tiles), batch=five,
                      name=f"gpt2-medium-bf16 + tiled head ({tiles} tiles)", **common)  # fmt: skip
    out: dict = {"budget": budget, "device": device, "head_tiles": tiles, "optimizer": optimizer, "policies": {},
                 "strategies": {}, "one_x": one, "five_x": five}  # fmt: skip
    none_speed = base.policies["none"].samples_per_s if "none" in base.policies else None
    for name in strategies:
        b, t = base.strategies[name], tiled.strategies[name]
        at5 = t.at(five) if five else None
        out["strategies"][name] = {
            "untiled_head": {"batch": b.max_batch, "samples_per_s": b.at_max.samples_per_s if b.at_max else None},
            "tiled_head": {"batch": t.max_batch, "samples_per_s": t.at_max.samples_per_s if t.at_max else None,
                           "at_5x": at5.samples_per_s if at5 and at5.fits else None,
                           "kept_at_5x": (at5.samples_per_s / none_speed) if at5 and at5.fits and none_speed else None,
                           "blocker": t.blocker},
        }
    for p in policies:
        b, t = base.policies[p], tiled.policies[p]
        out["policies"][p] = {
            "untiled_head": {"batch": b.max_batch, "samples_per_s": b.samples_per_s, "step_s": b.step_time},
            "tiled_head": {"batch": t.max_batch, "samples_per_s": t.samples_per_s, "step_s": t.step_time},
        }
    out["tables"] = {"untiled_head": base.table(), "tiled_head": tiled.table()}
    out["capture"] = head_accounting(tiles, optimizer=optimizer)
    return out


def markdown(res: dict, cmd: str) -> str:
    lines = [f"# GPT-2 medium bf16 on {res['device']}: the head and loss tiled along tokens", "",
             f"Command: `{cmd}`", "", f"Budget {res['budget']}, the head and loss in {res['head_tiles']} tiles of "
             "tokens, sequence length 1024, " + ("AdamW." if res.get("optimizer") == "adamw" else
             "SGD with momentum (the built-in workload's optimizer)."), "",
             "| policy | largest batch, untiled head | tiled head | samples/s untiled head | tiled head |",
             "|---|---|---|---|---|"]  # fmt: skip
    for p, r in res["policies"].items():
        u, t = r["untiled_head"], r["tiled_head"]
        lines.append(f"| {p} | {u['batch']} | {t['batch']} | {u['samples_per_s'] or 0:.1f} | "
                     f"{t['samples_per_s'] or 0:.1f} |")  # fmt: skip
    if res.get("strategies"):
        one, five = res["one_x"], res["five_x"]
        lines += ["", f"Strategies, 1x = the untiled model's no-swap batch ({one}); kept = samples/s over "
                  "its no-swap samples/s:", "",
                  f"| strategy | largest batch, untiled head | tiled head | samples/s at 5x ({five}), tiled head "
                  "(kept) |", "|---|---|---|---|"]  # fmt: skip
        for name, r in res["strategies"].items():
            u, t = r["untiled_head"], r["tiled_head"]
            at5 = f"{t['at_5x']:.1f} ({100 * t['kept_at_5x']:.0f} %)" if t["at_5x"] else "does not fit"
            lines.append(f"| {name} | {u['batch']} ({u['batch'] / one:.2f}x) | {t['batch']} ({t['batch'] / one:.2f}x)"
                         f" | {at5} |")  # fmt: skip
        for name, r in res["strategies"].items():
            if r["tiled_head"]["blocker"]:
                lines += ["", f"What stops {name} with the tiled head one sample past its largest batch: "
                          f"{r['tiled_head']['blocker']}"]  # fmt: skip
    c = res.get("capture")
    if c:
        u, t = c["untiled_head"], c["tiled_head"]
        lines += ["", f"What the capture records at batch {c['batch']} ({c['tokens']} tokens; the head's two gradient "
                  f"products are {c['head_products_gflop']:.1f} GFLOP): the tiled head takes its gradients in the "
                  "forward (Note [Gradients in the forward] in swap/tiling/plan/head.py) and recomputes nothing.",
                  "", "| head | forward GFLOP | backward GFLOP | saved for backward |", "|---|---|---|---|",
                  f"| untiled | {u['forward_gflop']:.1f} | {u['backward_gflop']:.1f} | {u['saved_mib']:.1f} MiB |",
                  f"| tiled | {t['forward_gflop']:.1f} | {t['backward_gflop']:.1f} | {t['saved_mib']:.1f} MiB |", "",
                  f"The tiled head's saves include the hidden states' gradient ({c['grad_hidden_mib']:.1f} MiB, bf16) "
                  f"and the weight's ({c['grad_weight_fp32_mib']:.1f} MiB, fp32), held from forward to backward; "
                  "the untiled loss saves tokens × vocab tensors instead."]  # fmt: skip
    for k, table in res["tables"].items():
        lines += ["", f"`swap.plan` ({k.replace('_', ' ')}):", "", "```", table, "```"]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="none,window", help="swap policies to plan, comma-separated")
    ap.add_argument("--strategies", default="",
                    help="keep / swap / recompute strategies of swap.plan to compare too, comma-separated (e.g. auto)")
    ap.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"),
                    help="sgd: the built-in workload's (SGD with momentum); adamw: bench.strategies' setting")
    ap.add_argument("--device", default="h100-sxm")
    ap.add_argument("--budget", default=None, help="default 80GiB (16GiB with --quick)")
    ap.add_argument("--tiles", type=int, default=16, help="tiles of tokens of the head and loss per step")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    budget = args.budget or ("16GiB" if args.quick else "80GiB")
    policies = tuple(p for p in args.policies.split(",") if p)
    strategies = tuple(p for p in args.strategies.split(",") if p)
    res = run(budget, args.device, policies, args.tiles, strategies, args.optimizer)
    cmd = "python -m bench.tiled_head " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tiled_head.json").write_text(json.dumps({"command": cmd.strip(), **res}, indent=1) + "\n")
    (out / "tiled_head.md").write_text(markdown(res, cmd.strip()))
    print(markdown(res, cmd.strip()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
