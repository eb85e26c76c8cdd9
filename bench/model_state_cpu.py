"""Model state beyond the budget, measured for real on CPU: a GPT-style model whose parameters, gradients and AdamW
state alone exceed the budget (30 % of the plain run's peak) trains under ``SwapManager(model=, optimizer=)``.

    python -m bench.model_state_cpu            # about five minutes on 2 shared cores
    python -m bench.model_state_cpu --quick    # a smaller model, fewer steps: a smoke run

The loop is a fine-tuning loop as users write it: AdamW with two param groups (no weight decay on norms and
biases), a StepLR scheduler, 2 micro-batches per optimizer step (gradient accumulation), and
``torch.nn.utils.clip_grad_norm_`` before every step. Four runs of a fresh model, each trained alike:
1. plain, under a LiveBytesMeter: the reference (losses, clip norms, parameters, gradients, optimizer state) and
   the plain peak; the budget is 30 % of it;
2. the manager (``placement="streamed"``: every bucket streamed, the host stepping it after ``opt.step()``),
   under an independent LiveBytesMeter: bitwise equal to 1? every iteration, the profiling ones included, within
   the budget? plan against reality: the activation plan's peak against the measured one, the host bytes
   predicted before anything was allocated against those allocated;
3. and 4. plain and the manager again without the independent meter, timed: the step-time ratio to plain is
   the median optimizer step (after the manager has planned) of one run over the other's. Wall clock and CPU
   time of the process (the copy and host-step workers included) are both given; the machine is shared.

One compute thread: the copy and host-step workers then have the second core, as a GPU's copy engines and the
host's cores do not compete with its kernels.

Writes <out>/model_state_cpu.json and model_state_cpu.md.
"""

from __future__ import annotations

import argparse
import gc
import logging
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

import swap
from bench.metering import metered
from bench.write import write_results
from swap.forecast import zoo
from swap.schedule.model_state import Bucket, plan_model_state

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.model_state_cpu")
FRACTION = 0.3
ACCUM = 2


class Setup:
    def __init__(self, quick: bool) -> None:
        shape = (2, 128, 1024, 64, 4) if quick else (4, 256, 2048, 128, 8)
        self.layers, self.d, self.vocab, self.seq, self.batch = shape
        self.steps = 4 if quick else 8
        self.bucket = "256KiB" if quick else "1MiB"

    def describe(self) -> str:
        return (f"GPT ({self.layers} layers, d={self.d}, vocab {self.vocab}, seq {self.seq}, batch {self.batch}), "
                f"AdamW (2 groups), StepLR, {ACCUM} micro-batches per step, clip_grad_norm_(1.0)")  # fmt: skip

    def build(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return zoo.gpt(n_layer=self.layers, n_head=4, d_model=self.d, vocab=self.vocab, seq_len=self.seq)

    def tokens(self, it: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=torch.Generator().manual_seed(it))
        return t[:, :-1], t[:, 1:]


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=3e-4, weight_decay=0.1)


def fused_steps(opt: torch.optim.Optimizer) -> None:
    """The plain reference steps with the kernel the manager's host step runs for torch's default AdamW, fused=True
    (Note [The host kernel] in swap/runtime/model_state/host_optim.py); its param groups keep fused=None."""

    def hook(value: Optional[bool]) -> Any:
        def set_fused(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            for g in o.param_groups:  # a pre-hook returns None or new (args, kwargs): nothing else (torch 2.13)
                g.update(fused=value)

        return set_fused

    opt.register_step_pre_hook(hook(True))
    opt.register_step_post_hook(hook(None))


def train(s: Setup, budget: Optional[int], meter: Optional[swap.LiveBytesMeter]) -> dict[str, Any]:
    """A fresh model trained ``s.steps`` optimizer steps, under the manager when ``budget`` is given."""
    gc.collect()
    model = s.build()
    opt = optimizer(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    sm = None
    if budget is None:
        fused_steps(opt)
    else:
        policy = swap.ModelStatePolicy(placement="streamed", bucket_bytes=s.bucket)
        sm = swap.SwapManager(budget=budget, device="cpu", model=model, optimizer=opt, model_state=policy,
                              min_bytes="64KiB")  # fmt: skip
    out: dict[str, Any] = {"losses": [], "norms": [], "peaks": [], "wall": [], "cpu": []}
    with metered(meter, sm):
        for step in range(s.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            opt.zero_grad()
            for micro in range(ACCUM):
                x, y = s.tokens(step * 100 + micro)
                out_ = model(x)
                loss = F.cross_entropy(out_.reshape(-1, out_.shape[-1]), y.reshape(-1))
                (loss / ACCUM).backward()
                out["losses"].append(loss.item())
                del loss, out_
                if meter is not None:
                    out["peaks"].append(meter.reset_window())
            out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
            opt.step()
            sched.step()
            out["wall"].append(time.perf_counter() - t0)
            out["cpu"].append(time.process_time() - c0)
            if meter is not None:
                out["peaks"][-1] = max(out["peaks"][-1], meter.reset_window())
            log.info("%s step %d: %.2f s", "manager" if sm else "plain", step, out["wall"][-1])
    # numpy copies: a meter counting the CPU "device" in a later run must not count the reference's tensors
    out["params"] = [p.detach().numpy().copy() for p in model.parameters()]
    out["grads"] = [p.grad.detach().numpy().copy() for p in model.parameters()]
    out["state"] = _numpy(opt.state_dict())
    out["manager"] = sm
    out["n_params"] = sum(p.numel() for p in model.parameters())
    if sm is not None:  # the planner's view of the buckets the run streamed (swap.schedule.model_state)
        buckets = [Bucket(**b) for b in sm.report()["model_state"]["bucket_specs"]]
        out["planner"] = plan_model_state(buckets, budget, placement="streamed")
    return out


def _numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().numpy().copy()
    if isinstance(value, dict):
        return {k: _numpy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_numpy(v) for v in value)
    return value


def same(a: Any, b: Any) -> bool:
    """Bitwise equal: arrays by their bytes, containers element by element."""
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def measure(s: Setup) -> dict[str, Any]:
    log.info("plain run under a meter")
    plain = train(s, None, swap.LiveBytesMeter("cpu"))
    peak = max(plain["peaks"])
    budget = int(FRACTION * peak)
    model_state = 16 * plain["n_params"]  # fp32 weights, gradients, AdamW's two moments
    log.info("plain peak %.1f MiB; budget %.1f MiB; model state %.1f MiB", peak / 2**20, budget / 2**20,
             model_state / 2**20)  # fmt: skip
    log.info("manager under a meter")
    got = train(s, budget, swap.LiveBytesMeter("cpu"))
    r = got["manager"].report()
    ms = r["model_state"]
    checks = {k: same(plain[k], got[k]) for k in ("losses", "norms", "params", "grads", "state")}
    planned = r["planned_peak_bytes"]
    planner = got["planner"]
    measured_planned = max(got["peaks"][2 * ACCUM :]) if len(got["peaks"]) > 2 * ACCUM else None
    log.info("timing: plain, then the manager, without the independent meter")
    t_plain = train(s, None, None)
    t_ms = train(s, budget, None)
    skip = 2  # the manager profiles two iterations (the first optimizer step), then plans
    ratio = {k: statistics.median(t_ms[k][skip:]) / statistics.median(t_plain[k][skip:]) for k in ("wall", "cpu")}
    return {
        "model": s.describe(), "parameters": plain["n_params"], "plain_peak_bytes": peak, "budget_bytes": budget,
        "model_state_bytes": model_state, "model_state_over_budget": model_state > budget,
        "bitwise": checks, "peaks": got["peaks"], "within_budget": max(got["peaks"]) <= budget,
        "planned_peak_bytes": planned, "measured_peak_after_planning_bytes": measured_planned,
        "host_bytes": ms["host_bytes"], "host_bytes_predicted": ms["host_bytes_predicted"],
        "planner_host_bytes": planner.host_bytes, "planner_notes": planner.notes,
        "status": r["status"], "buckets": ms["buckets"], "placements": ms["placements"],
        "per_step": ms["steps"], "host_step_seconds": ms["host_step_seconds"],
        "host_step_exposed_seconds": ms["host_step_exposed_seconds"],
        "step_seconds": {"plain_wall": t_plain["wall"], "manager_wall": t_ms["wall"], "plain_cpu": t_plain["cpu"],
                         "manager_cpu": t_ms["cpu"]},
        "step_time_ratio": ratio, "report": str(r),
    }  # fmt: skip


def within(a: Optional[int], b: Optional[int]) -> str:
    return "-" if not a or not b else f"{100 * (a - b) / b:+.1f} %"


def markdown(res: dict[str, Any], command: str) -> str:
    mib = 2**20
    b = res["bitwise"]
    lines = [
        "# Model state beyond the budget, measured on CPU", "",
        f"`{command}` ({res['torch']}, {res['machine']}, one compute thread)", "",
        f"{res['model']}: {res['parameters'] / 1e6:.2f} M parameters.", "",
        "| | |", "|---|---|",
        f"| plain peak (LiveBytesMeter) | {res['plain_peak_bytes'] / mib:.1f} MiB |",
        f"| budget (30 % of it) | {res['budget_bytes'] / mib:.1f} MiB |",
        f"| weights + gradients + AdamW state | {res['model_state_bytes'] / mib:.1f} MiB "
        f"({'over' if res['model_state_over_budget'] else 'under'} the budget) |",
        f"| bitwise equal to plain | losses {b['losses']}, clip norms {b['norms']}, parameters {b['params']}, "
        f"gradients {b['grads']}, optimizer state {b['state']} |",
        f"| every iteration within the budget | {res['within_budget']} (highest {max(res['peaks']) / mib:.1f} MiB) |",
        f"| step-time ratio to plain (median step) | {res['step_time_ratio']['wall']:.2f} wall, "
        f"{res['step_time_ratio']['cpu']:.2f} CPU time |",
        f"| placements | {res['placements']} ({res['buckets']} buckets) |",
        f"| host optimizer | {res['host_step_seconds']:.2f} s, {res['host_step_exposed_seconds']:.2f} s of it "
        "waited for |",
        "", "## Plan against reality", "",
        "| | predicted | measured | difference |", "|---|---|---|---|",
        f"| peak after planning | {(res['planned_peak_bytes'] or 0) / mib:.1f} MiB | "
        f"{(res['measured_peak_after_planning_bytes'] or 0) / mib:.1f} MiB | "
        f"{within(res['measured_peak_after_planning_bytes'], res['planned_peak_bytes'])} |",
        f"| host bytes (the runtime, before allocating) | {res['host_bytes_predicted'] / mib:.2f} MiB | "
        f"{res['host_bytes'] / mib:.2f} MiB | {within(res['host_bytes'], res['host_bytes_predicted'])} |",
        f"| host bytes (plan_model_state) | {res['planner_host_bytes'] / mib:.2f} MiB | "
        f"{res['host_bytes'] / mib:.2f} MiB | {within(res['host_bytes'], res['planner_host_bytes'])} |",
        "", "The predicted peak is the one plan's: activations and the streamed weights (clean variables) "
        "scheduled together on the profiled iteration, measured after planning by the independent meter.",
        "", "## The manager's report", "", "```", res["report"], "```", "",
    ]  # fmt: skip
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller model, fewer steps (a smoke run)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    res = measure(Setup(args.quick))
    res.update(torch=torch.__version__, machine=platform.machine(), quick=args.quick)
    command = "python -m bench.model_state_cpu" + (" --quick" if args.quick else "")
    write_results(args.out, "model_state_cpu" + ("_quick" if args.quick else ""), res, markdown(res, command))
    return 0 if res["within_budget"] and all(res["bitwise"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
