"""Simulated: a Llama-3-70B-shaped model, full AdamW fine-tune, on 8 x H100-80GB with FSDP2 (``fully_shard`` on
each decoder layer and the root, NVLink 4): the largest tokens per step and tokens/s per configuration.

    python -m bench.fsdp_70b              # sequence 4096 (about fifteen minutes on 2 shared cores)
    python -m bench.fsdp_70b --seq 2048

One rank is forecast (``swap.plan(..., world_size=8, shard="fsdp2", interconnect="nvlink4")``: Note [One rank
of FSDP2] and Note [Collectives on the step] in swap/forecast/distributed.py) on the ``h100-sxm`` profile, its
budget the card's 80 GiB, the ideal allocator (no fragmentation). The rows (``ROWS``):
- model state in bf16 (parameters, gradients and AdamW's two moments: 8 bytes a parameter), resident:
  - FSDP2 with full activation checkpointing: every decoder layer checkpointed, nothing swapped (strategy
    "checkpoint", what torchtitan's ``ac_mode=full`` does);
  - FSDP2 with our activation plan: strategy "auto" (keep, swap to the host, recompute);
- fp32 master weights and AdamW state with bf16 compute (``MixedPrecisionPolicy(param_dtype=bf16)``: 16 bytes a
  parameter): its model state alone is compared with the budget; it is trained with model-state offload
  (``swap.fsdp2``: FSDP2's ``CPUOffloadPolicy`` per unit, the host step after ``opt.step()``): every unit's
  state goes to the host (``server-ddr5-8ch``, one host for the 8 ranks) except the fewest, kept resident from
  the root and the first layers on, that the host's pinnable memory cannot hold
  (``swap.forecast.fsdp2_lanes.keep_resident``); the resident units' fp32 state is taken off the budget, and
  ``swap.plan(..., shard=Offload(...))`` plans the activations in the rest and prices the shard copies and host
  steps (Note [Model-state offload on one rank]). The host also holds the ranks' activation swap pools (each at
  most the bytes its rank swaps out a step): a row's batch is the largest whose pools fit beside the model state.
  Full checkpointing swaps nothing; our plan is shown with the host filled by model state, and with a quarter of
  its pinnable memory kept for the swap pools (more units resident: less device room for activations).
Tokens per step count all 8 ranks (8 x per-rank batch x sequence).

Writes <out>/fsdp_70b.json and fsdp_70b.md.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

import swap
from bench.write import write_results
from swap.forecast.distributed import Offload, fsdp2
from swap.forecast.fsdp2_lanes import keep_resident

ROOT = Path(__file__).resolve().parents[1]
WORLD, DEVICE, LINK, BUDGET = 8, "h100-sxm", "nvlink4", 80 << 30
HOST = "server-ddr5-8ch"  # one host for the 8 ranks
LLAMA3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192)  # fmt: skip


def model_fn(layers: int = 80) -> torch.nn.Module:
    """Llama-3-70B's shape (Hugging Face ``LlamaForCausalLM``, untied head, SDPA attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**LLAMA3_70B, "num_hidden_layers": layers}, attn_implementation="sdpa", use_cache=False,
                      tie_word_embeddings=False)  # fmt: skip
    return LlamaForCausalLM(cfg)


def batch_fn(seq: int, n: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, LLAMA3_70B["vocab_size"], (n, seq))
    return {"input_ids": ids, "labels": ids}


@dataclass(frozen=True)
class Row:
    name: str
    strategy: Optional[str]  # a strategy of swap.plan at bf16, or None: judged on its model state
    bytes_per_parameter: int  # parameters, gradients and AdamW state
    offload: bool = False  # model-state offload (FSDP2 CPUOffloadPolicy per unit, our host step)
    reserve: float = 0.0  # with offload: the share of the host's pinnable memory kept for activation swap pools
    at: Optional[str] = None  # at this strategy's largest batch, not at its own


ROWS = [
    Row("FSDP2, full activation checkpointing, bf16 state", "checkpoint", 8),
    Row("FSDP2 + our activation plan (auto), bf16 state", "auto", 8),
    Row("FSDP2 + our activation plan (auto), bf16 state, at full checkpointing's batch", "auto", 8, at="checkpoint"),
    Row("FSDP2, fp32 master and AdamW state, no offload", None, 16),
    Row("FSDP2, full activation checkpointing, fp32 master and state, model-state offload", "checkpoint", 16,
        offload=True),
    Row("FSDP2 + our activation plan (auto), fp32 master and state, model-state offload", "auto", 16, offload=True),
    Row("FSDP2 + our activation plan (auto), fp32 master and state, model-state offload, a quarter of the host "
        "kept for activation swaps", "auto", 16, offload=True, reserve=0.25),
]


def adamw(params: Any) -> torch.optim.Optimizer:
    """AdamW as torchtitan runs it (``fused=True``), which the meta capture cannot run: ``foreach=False`` has
    the same memory (no list-wide temporaries) and per-operator costs on the same roofline."""
    return torch.optim.AdamW(params, lr=1e-5, foreach=False)


def forecast(seq: int, strategies: tuple[str, ...], max_batch: int, budget: int = BUDGET,
             shard: Any = "fsdp2") -> Any:  # fmt: skip
    return swap.plan(model_fn, functools.partial(batch_fn, seq), budget=budget, device=DEVICE, allocator=None,
                     max_batch=max_batch, optimizer=adamw, dtype=torch.bfloat16, policies=("none",),
                     strategies=strategies, world_size=WORLD, shard=shard, interconnect=LINK,
                     name="llama3-70b")  # fmt: skip


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fsdp_70b", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    ap.add_argument("--max-batch", type=int, default=64, help="the largest per-rank batch searched")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    fs = fsdp2(model_fn, WORLD, LINK, torch.bfloat16)
    params = sum(u.param_bytes for u in fs.units) // 2  # bf16: 2 bytes each
    bf16 = [r.strategy for r in ROWS if r.strategy and not r.offload]
    plan = forecast(args.seq, tuple(bf16), args.max_batch)
    offload = {share: _offload_plan(args.seq, args.max_batch, tuple(r.strategy for r in ROWS if r.offload
                                                                    and r.reserve == share), fs, share)
               for share in sorted({r.reserve for r in ROWS if r.offload})}  # fmt: skip
    rows = []
    for r in ROWS:
        state = r.bytes_per_parameter * params / WORLD
        row: dict[str, Any] = {"row": r.name, "model_state_per_rank": state}
        if r.offload:
            row.update(_offload_row(offload[r.reserve], r.strategy, args.seq))
        elif r.strategy is None:
            row["result"] = (f"does not fit: {state / 2**30:.1f} GiB of model state per rank > the "
                             f"{BUDGET / 2**30:.0f} GiB budget")  # fmt: skip
        else:
            batch = plan.strategies[r.at].max_batch if r.at else None
            row.update(_point(plan.strategies[r.strategy], args.seq, batch))
        rows.append(row)
        print(row)
    lines = [
        "# Llama-3-70B shape, full AdamW, 8 x H100-80GB with FSDP2 (simulated)",
        "",
        f"`python -m bench.fsdp_70b --seq {args.seq}`: one rank forecast by `swap.plan(..., world_size={WORLD}, "
        f"shard='fsdp2', interconnect='{LINK}')` on the `{DEVICE}` profile, budget {BUDGET / 2**30:.0f} GiB per "
        f"rank, ideal allocator; {params / 1e9:.1f} B parameters, sequence {args.seq}, per-rank batch searched up "
        f"to {args.max_batch}; AdamW with `foreach=False` standing in for `fused=True` (`bench.fsdp_70b.adamw`)."
        f" Tokens per step count the {WORLD} ranks. Collectives on NVLink 4 (360 GB/s bus "
        "bandwidth); recompute is not credited with hiding them.",
        "",
        "| configuration | model state per rank | largest tokens per step | tokens/s | step time | planned peak "
        "per rank | plan |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        state = f"{row['model_state_per_rank'] / 2**30:.1f} GiB"
        if "result" in row:
            lines.append(f"| {row['row']} | {state} | {row['result']} | | | | |")
        else:
            lines.append(f"| {row['row']} | {state} | {row['tokens_per_step']:,} | {row['tokens_per_s']:,.0f} | "
                         f"{row['step_time']:.2f} s | {row['peak'] / 2**30:.1f} GiB | {row['plan']} |")
    for row in rows:
        if "resident" in row:
            kept = ", ".join(u or "root" for u in row["resident"]) or "none"
            lines += ["", f"{row['row']}: resident (on the device, fp32, taken off the budget: "
                          f"{row['resident_bytes'] / 2**30:.1f} GiB a rank): {kept}; the rest on the `{HOST}` host: "
                          f"{row['host_state_bytes'] / 2**30:.0f} GiB of model state and "
                          f"{row['swap_pool_bytes'] / 2**30:.0f} GiB of activation swap pools for the 8 ranks, in "
                          f"{row['pinnable'] / 2**30:.0f} GiB pinnable (the device alone would hold "
                          f"{row['largest_on_the_device']} sequences a rank). "
                          f"{row.get('offload', row.get('result', ''))}."]  # fmt: skip
    lines += ["", *(f"note: {n}" for n in plan.notes)]
    write_results(Path(args.out), "fsdp_70b", {"seq": args.seq, "world_size": WORLD, "device": DEVICE,
                                               "interconnect": LINK, "budget": BUDGET, "parameters": params,
                                               "rows": rows, "notes": plan.notes}, "\n".join(lines) + "\n")  # fmt: skip
    return 0


def _offload_plan(seq: int, max_batch: int, strategies: tuple[str, ...], fs: Any, reserve: float) -> dict[str, Any]:
    """Model-state offload: the fewest units resident (their fp32 state taken off the budget) for the rest of the
    8 ranks' model state to fit the host's pinnable memory less the ``reserve`` share of it; ``strategies``
    planned in what is left."""
    numel, host = fs.shard_numel(), Offload(HOST, ranks_per_host=WORLD)
    spec = keep_resident(numel, host, int(host.profile.pinnable * reserve))
    kept, per = sum(n for u, n in numel.items() if u in spec.resident), spec.bytes_per_parameter()
    resident, host_state = kept * per, (sum(numel.values()) - kept) * WORLD * per
    plan = forecast(seq, strategies, max_batch, budget=BUDGET - resident, shard=spec)
    return {"plan": plan, "spec": spec, "resident": resident, "host_state": host_state, "order": list(numel)}


def _offload_row(o: dict[str, Any], strategy: str, seq: int) -> dict[str, Any]:
    """``strategy``'s largest batch whose activation swap pools (8 ranks, each at most the bytes its rank swaps
    out a step) fit the host's pinnable memory beside the offloaded model state."""
    spec, result = o["spec"], o["plan"].strategies[strategy]
    room = spec.profile.pinnable - o["host_state"]
    fits = [n for n, p in sorted(result.points.items()) if p.fits and WORLD * p.copied_bytes // 2 <= room]
    largest = result.at_max
    row: dict[str, Any] = {"largest_on_the_device": largest.batch if largest is not None and largest.fits else 0}
    if fits:
        row.update(_point(result, seq, fits[-1]))
        row["peak"] += o["resident"]  # the resident units' fp32 state, taken off the plan's budget
        row["offload"] = next(n for n in o["plan"].notes if n.startswith(f"model-state offload at batch {fits[-1]}:"))
    else:
        swaps = {n: p.copied_bytes // 2 for n, p in result.points.items() if p.fits}
        least = min(swaps, key=swaps.__getitem__, default=None)
        row["result"] = "no batch's activation swap pools fit the host beside the model state" + (
            f" (the least a plan swaps: {swaps[least] / 2**30:.0f} GiB a rank, at batch {least}; the host has "
            f"{room / WORLD / 2**30:.0f} GiB a rank)" if least is not None else "")  # fmt: skip
    pool = WORLD * result.at(fits[-1]).copied_bytes // 2 if fits else 0
    return {**row, "resident": [u for u in o["order"] if u in spec.resident], "resident_bytes": o["resident"],
            "host_state_bytes": o["host_state"], "swap_pool_bytes": pool, "pinnable": spec.profile.pinnable}


def _point(result: Any, seq: int, batch: Optional[int] = None) -> dict[str, Any]:
    p = result.at_max if batch is None else result.at(batch)
    if p is None or not p.fits:
        return {"result": f"does not fit one sequence of {seq} tokens per rank: {result.blocker}"}
    return {"batch_per_rank": p.batch, "tokens_per_step": p.batch * seq * WORLD,
            "tokens_per_s": p.batch * seq * WORLD / p.step_time, "step_time": p.step_time, "peak": p.peak,
            "plan": p.plan}  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
