"""FSDP2 under the manager, judged by an independent meter that re-reads every live storage's size at each
operator (sweep_meter.SweepMeter, Note [Sweeping every storage]), so FSDP2's in-place storage resizes are seen:
each block of an nn.Sequential under ``fully_shard``, a manager per rank, two gloo ranks, AdamW, the budget
halfway between the rank's static bytes and its plain peak. (Issue 35 item 3 saw planned iterations at 124 %
of the budget by such a meter; this setting is within it on main at the time of writing, the manager's peak
equal to the meter's: a guard, not a reproduction.)"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import fully_shard

import swap

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_ranks import spawn  # noqa: E402
from sweep_meter import SweepMeter  # noqa: E402

D, HIDDEN, BLOCKS, TOKENS = 128, 512, 6, 2048


def build() -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(D, HIDDEN), torch.nn.GELU(),
                                                      torch.nn.Linear(HIDDEN, D)) for _ in range(BLOCKS)])  # fmt: skip
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model


def train(rank: int, budget: int = 0, iterations: int = 5) -> dict[str, Any]:
    """AdamW steps on this rank; each iteration's peak by the sweep meter, the static bytes after the first step,
    and the manager's report (``budget`` 0: no manager)."""
    model = build()
    opt = torch.optim.AdamW(model.parameters())
    meter = SweepMeter().track_existing()
    sm = swap.SwapManager(budget=budget, device="cpu") if budget else None
    peaks, static = [], 0
    with meter:
        meter.reset_window()
        if sm is not None:
            sm.__enter__()
        try:
            for it in range(iterations):
                x = torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(100 * rank + it))
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                peaks.append(meter.reset_window())
                if it == 0:
                    static = meter.live  # weights and AdamW's moments (shards), gradients freed
        finally:
            if sm is not None:
                sm.__exit__(None, None, None)
    return {"peaks": peaks, "static": static, "report": dict(sm.report()) if sm is not None else None}


def _ranks(rank: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    plain = train(rank)
    budget = (plain["static"] + max(plain["peaks"])) // 2
    return {"plain": plain, "managed": train(rank, budget), "budget": budget}


def test_fsdp2_planned_iterations_are_within_the_budget_by_the_sweep_meter(tmp_path):
    for rank, r in enumerate(spawn(_ranks, tmp_path)):
        budget, report = r["budget"], r["managed"]["report"]
        assert report["status"] == "planned", (rank, report["status"], report["notes"])
        planned = r["managed"]["peaks"][report["profiling_iterations"]:]
        assert max(planned) <= budget, f"rank {rank}: planned peaks {planned} over the budget {budget}"
        # The manager's own peak agrees with the independent meter within 1 %.
        assert abs(report["peak_device_bytes"] - max(r["managed"]["peaks"])) <= 0.01 * max(r["managed"]["peaks"])
