"""Mixed precision for offloaded model state, measured on CPU (issue 37, item 6, first bullet):
``SwapManager(model=, optimizer=, compute_dtype=torch.bfloat16)`` on a GPT-style model whose fp32 weights,
gradients and AdamW state alone exceed the budget (30 % of plain fp32 training's peak).

    python -m bench.mixed_precision_cpu            # about five minutes on 2 shared cores
    python -m bench.mixed_precision_cpu --quick    # a smaller model, fewer steps: a smoke run

The loop is bench.model_state_cpu's (AdamW with two param groups, StepLR, 2 micro-batches a step,
``clip_grad_norm_(1.0)``). Runs of a fresh model, each trained alike:
1. plain fp32, under a LiveBytesMeter: its peak sets the budget;
2. the reference: the loop written out as FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
   runs one rank (fp32 masters stepped by AdamW with the host's kernel, a bf16 copy cast from them before each
   micro-batch, each backward's bf16 gradient upcast and added in fp32, clipping over the fp32 gradients);
3. the manager with ``compute_dtype=torch.bfloat16`` (``model_state="offload"``), under an independent
   LiveBytesMeter (its own instance; it follows in-place ``UntypedStorage.resize_``, Note [Storages that resize]):
   bitwise equal to 2? every iteration, the profiling ones included, within the budget? host bytes predicted
   against allocated; bytes over the link a step;
4. the manager on the fp32 model without ``compute_dtype`` (today's offload: fp32 weights and gradients on the
   link), same budget and meter: its link bytes a step and host bytes, for comparison;
5. and 6. the reference and the mixed manager again without a meter, timed (median optimizer step after the
   manager planned, wall clock and process CPU time; the machine is shared, one compute thread).

Writes <out>/mixed_precision_cpu.json and mixed_precision_cpu.md.
"""

from __future__ import annotations

import argparse
import copy
import gc
import logging
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

import swap
from bench.metering import metered
from bench.model_state_cpu import ACCUM, FRACTION, Setup, optimizer, same
from bench.write import write_results

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.mixed_precision_cpu")
BF16 = torch.bfloat16


def fused_steps(opt: torch.optim.Optimizer) -> None:
    """The reference steps with the kernel the host step runs for torch's default AdamW, fused=True (Note [The host
    kernel] in swap/runtime/model_state/host_optim.py); its param groups keep fused=None."""

    def hook(value: Optional[bool]) -> Any:
        def set_fused(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            for g in o.param_groups:
                g["fused"] = value

        return set_fused

    opt.register_step_pre_hook(hook(True))
    opt.register_step_post_hook(hook(None))


def small(quick: bool) -> Setup:
    s = Setup(quick=True)
    if quick:
        s.layers, s.d, s.vocab, s.seq, s.batch, s.steps, s.bucket = 2, 64, 256, 32, 4, 3, "32KiB"
    else:
        s.steps = 6
    return s


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def train(s: Setup, mode: str, budget: Optional[int] = None, meter: Any = None) -> dict[str, Any]:
    """``mode``: "plain" (fp32), "reference" (the mixed-precision oracle), "mixed" (the manager with
    compute_dtype=bf16) or "fp32" (the manager on the fp32 model)."""
    gc.collect()
    model = s.build()
    opt = optimizer(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    sm = None
    shadow = None
    if mode in ("plain", "reference"):
        fused_steps(opt)
    else:
        sm = swap.SwapManager(budget=budget, device="cpu", model=model, optimizer=opt, model_state="offload",
                              bucket_bytes=s.bucket, min_bytes="64KiB",
                              compute_dtype=BF16 if mode == "mixed" else None)  # fmt: skip
    if mode == "reference":
        shadow = copy.deepcopy(model).to(BF16)
        pairs = list(zip(model.parameters(), shadow.parameters()))
    out: dict[str, Any] = {"losses": [], "norms": [], "peaks": [], "wall": [], "cpu": []}
    with metered(meter, sm):
        for step in range(s.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            opt.zero_grad()
            for micro in range(ACCUM):
                x, y = s.tokens(step * 100 + micro)
                if shadow is not None:
                    with torch.no_grad():
                        for master, c in pairs:
                            c.copy_(master)
                loss = _loss(shadow if shadow is not None else model, x, y)
                (loss / ACCUM).backward()
                out["losses"].append(loss.item())
                del loss
                if shadow is not None:
                    for master, c in pairs:
                        if c.grad is not None:
                            g = c.grad.float()
                            master.grad = g if master.grad is None else master.grad.add_(g)
                            c.grad = None
                if meter is not None:
                    out["peaks"].append(meter.reset_window())
            out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
            opt.step()
            sched.step()
            out["wall"].append(time.perf_counter() - t0)
            out["cpu"].append(time.process_time() - c0)
            if meter is not None:
                out["peaks"][-1] = max(out["peaks"][-1], meter.reset_window())
            log.info("%s step %d: %.2f s", mode, step, out["wall"][-1])
    out["params"] = [p.detach().numpy().copy() for p in model.parameters()]
    out["grads"] = [p.grad.detach().numpy().copy() for p in model.parameters()]
    out["state"] = {k: v for k, v in _numpy(opt.state_dict()).items()}
    out["n_params"] = sum(p.numel() for p in model.parameters())
    out["report"] = sm.report() if sm is not None else None
    # page-locked on a CUDA run (a CPU run pins nothing): what the copies read and write
    out["pinned_on_cuda"] = sm.model_state.prediction.pinned if sm is not None else None
    return out


def _numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().numpy().copy()
    if isinstance(value, dict):
        return {k: _numpy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_numpy(v) for v in value)
    return value


def link(report: dict[str, Any]) -> dict[str, float]:
    """Median bytes a step over the link, after the first (profiling) step: weights in, gradients out."""
    rows = report["model_state"]["steps"][1:]
    return {k: statistics.median(r[k] for r in rows) for k in ("weights_in_bytes", "grads_out_bytes")}


def measure(s: Setup) -> dict[str, Any]:
    log.info("plain fp32 under a meter")
    plain = train(s, "plain", meter=swap.LiveBytesMeter("cpu"))
    peak = max(plain["peaks"])
    budget = int(FRACTION * peak)
    log.info("the reference loop")
    ref = train(s, "reference")
    log.info("the manager, compute_dtype=bf16, under an independent meter")
    got = train(s, "mixed", budget, swap.LiveBytesMeter("cpu"))
    log.info("the manager, fp32, under an independent meter")
    fp32 = train(s, "fp32", budget, swap.LiveBytesMeter("cpu"))
    log.info("timing: the reference, then the mixed manager, without a meter")
    t_ref = train(s, "reference")
    t_mixed = train(s, "mixed", budget)
    skip = 1  # the manager profiles the first optimizer step's two iterations, then plans
    ratio = {k: statistics.median(t_mixed[k][skip:]) / statistics.median(t_ref[k][skip:]) for k in ("wall", "cpu")}
    r, rf = got["report"], fp32["report"]
    ms, msf = r["model_state"], rf["model_state"]
    return {
        "model": s.describe(), "parameters": plain["n_params"], "plain_peak_bytes": peak, "budget_bytes": budget,
        "fp32_model_state_bytes": 16 * plain["n_params"],
        "precision": ms["precision"], "fp32_precision": msf["precision"],
        "bitwise": {k: same(ref[k], got[k]) for k in ("losses", "norms", "params", "grads", "state")},
        "peaks": got["peaks"], "within_budget": max(got["peaks"]) <= budget,
        "fp32_peaks": fp32["peaks"], "fp32_within_budget": max(fp32["peaks"]) <= budget,
        "host_bytes": ms["host_bytes"], "host_bytes_predicted": ms["host_bytes_predicted"],
        "pinned_on_cuda": got["pinned_on_cuda"],
        "fp32_host_bytes": msf["host_bytes"], "fp32_pinned_on_cuda": fp32["pinned_on_cuda"],
        "link_per_step": link(r), "fp32_link_per_step": link(rf),
        "status": r["status"], "buckets": ms["buckets"], "placements": ms["placements"],
        "step_seconds": {"reference_wall": t_ref["wall"], "mixed_wall": t_mixed["wall"],
                         "reference_cpu": t_ref["cpu"], "mixed_cpu": t_mixed["cpu"]},
        "step_time_ratio": ratio, "report": str(r),
    }  # fmt: skip


def markdown(res: dict[str, Any], command: str) -> str:
    mib = 2**20
    b = res["bitwise"]
    lk, lf = res["link_per_step"], res["fp32_link_per_step"]
    lines = [
        "# Mixed precision for offloaded model state, measured on CPU", "",
        f"`{command}` ({res['torch']}, {res['machine']}, one compute thread)", "",
        f"{res['model']}: {res['parameters'] / 1e6:.2f} M parameters. The manager ran "
        f"`compute_dtype=torch.bfloat16`, model_state=\"offload\"; its report says "
        f"precision \"{res['precision']}\".", "",
        "| | |", "|---|---|",
        f"| plain fp32 peak (LiveBytesMeter) | {res['plain_peak_bytes'] / mib:.2f} MiB |",
        f"| budget (30 % of it) | {res['budget_bytes'] / mib:.2f} MiB |",
        f"| fp32 weights + gradients + AdamW state | {res['fp32_model_state_bytes'] / mib:.2f} MiB |",
        f"| bitwise equal to the reference loop | losses {b['losses']}, clip norms {b['norms']}, parameters "
        f"{b['params']}, gradients {b['grads']}, optimizer state {b['state']} |",
        f"| every iteration within the budget (independent meter) | {res['within_budget']} (highest "
        f"{max(res['peaks']) / mib:.2f} MiB) |",
        f"| host bytes predicted / allocated | {res['host_bytes_predicted'] / mib:.2f} / "
        f"{res['host_bytes'] / mib:.2f} MiB |",
        f"| step-time ratio to the reference loop (median step) | {res['step_time_ratio']['wall']:.2f} wall, "
        f"{res['step_time_ratio']['cpu']:.2f} CPU time |",
        "", "## Against today's fp32 offload (same model, budget and meter)", "",
        "| a step (median after the first) | mixed bf16 / fp32 master | fp32 |", "|---|---|---|",
        f"| weights over the link (H2D) | {lk['weights_in_bytes'] / mib:.2f} MiB | "
        f"{lf['weights_in_bytes'] / mib:.2f} MiB |",
        f"| gradients over the link (D2H) | {lk['grads_out_bytes'] / mib:.2f} MiB | "
        f"{lf['grads_out_bytes'] / mib:.2f} MiB |",
        f"| host bytes (of them page-locked on a CUDA run) | {res['host_bytes'] / mib:.2f} "
        f"({res['pinned_on_cuda'] / mib:.2f}) MiB | {res['fp32_host_bytes'] / mib:.2f} "
        f"({res['fp32_pinned_on_cuda'] / mib:.2f}) MiB |",
        f"| every iteration within the budget | {res['within_budget']} | {res['fp32_within_budget']} |",
        "", "The reference is FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` on one rank, "
        "written out as a loop (Note [Mixed precision] in swap/runtime/model_state/precision.py). A CPU has no "
        "link: the bytes are what the runtime's copies moved. On CPU a bf16 matmul may be slower than an fp32 "
        "one; the step-time ratio compares like with like (both compute in bf16).",
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
    res = measure(small(args.quick))
    res.update(torch=torch.__version__, machine=platform.machine(), quick=args.quick)
    command = "python -m bench.mixed_precision_cpu" + (" --quick" if args.quick else "")
    write_results(args.out, "mixed_precision_cpu" + ("_quick" if args.quick else ""), res, markdown(res, command))
    return 0 if res["within_budget"] and all(res["bitwise"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
