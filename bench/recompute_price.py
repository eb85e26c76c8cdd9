"""What checkpointing costs on the planner's clock, priced per operator against per segment.

    python -m bench.recompute_price     # ~1 minute: four captures

ResNet-50 (fp32, 224^2, batch 984) and GPT-2 medium (bf16, 1024 tokens, batch 37), the built-in models
(swap.forecast.zoo), captured plain and with every bottleneck / transformer block under
``torch.utils.checkpoint(use_reentrant=False)`` (bench.plan_vs_reality_time.checkpointed), and priced on the
H100-SXM profile two ways: per operator (what the planner does, Note [Per-operator roofline]) and per
segment (one roofline over all the operators between two saved-tensor events, as the planner priced before Note
[Per-operator roofline]). The step is the compute of the last captured iteration, no swapping.

Writes bench/results/recompute_price.{json,md}.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from bench.plan_vs_reality_time import checkpointed
from bench.write import write_results
from swap.capture import OP, SAVE, USE, Trace, capture
from swap.devices import DeviceProfile, profile
from swap.forecast.pricing import iteration_seconds, low_precision_model
from swap.forecast.zoo import ZOO

ROOT = Path(__file__).resolve().parents[1]
CASES = (("resnet50", 984), ("gpt2-medium-bf16", 37))  # the largest no-swap batches on h100-sxm
DEVICE = "h100-sxm"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def segment_seconds(trace: Trace, dev: DeviceProfile) -> float:
    """The last iteration priced per segment: the roofline over the summed FLOPs and bytes of the operators
    between two saved-tensor events (the per-segment pricing), at the model's precision."""
    b, e = trace.iterations()[-1]
    op, flops, nbytes = trace.op[b : e + 1], trace.flops[b : e + 1], trace.bytes[b : e + 1]
    cut = np.cumsum((op == SAVE) | (op == USE))  # segment number of each event
    ops = op == OP
    f = np.bincount(cut[ops], weights=flops[ops])
    m = np.bincount(cut[ops], weights=nbytes[ops])
    return float(np.sum(dev.step_seconds(f, m, low_precision_model(trace))))


def price(name: str, batch: int, dev: DeviceProfile) -> dict[str, Any]:
    w = ZOO[name]
    out: dict[str, Any] = {"model": name, "batch": batch}
    builds: dict[str, Callable[[], torch.nn.Module]] = {"plain": w.model_fn(),
                                                        "checkpointed": checkpointed(w.model_fn())}  # fmt: skip
    for run, build in builds.items():
        t0 = time.perf_counter()
        trace = capture(build, w.batch_fn(), batch, optimizer=w.optimizer, dtype=w.dtype, name=name)
        b, e = trace.iterations()[-1]
        out[run] = {"flops": float(trace.flops[b : e + 1].sum()), "per_operator": iteration_seconds(trace, dev),
                    "per_segment": segment_seconds(trace, dev)}  # fmt: skip
        log(f"{name} batch {batch} {run}: {out[run]['per_operator'] * 1e3:.1f} ms per operator, "
            f"{out[run]['per_segment'] * 1e3:.1f} ms per segment ({time.perf_counter() - t0:.1f} s)")
    return out


def markdown(results: dict[str, Any]) -> str:
    m = results["meta"]
    lines = [f"Command: `{m['command']}` ({m['date']}, torch {m['torch']}); device profile: {m['device']}.", "",
             "Compute of one training step, no swapping; checkpointed = every bottleneck / transformer block under "
             "`torch.utils.checkpoint(use_reentrant=False)`. Per operator: the planner's clock; per segment: one "
             "roofline per run of operators between saved-tensor events (the per-segment pricing).", "",
             "| model | batch | FLOPs checkpointed / plain | per operator: plain / checkpointed ms (ratio) "
             "| per segment: plain / checkpointed ms (ratio) | per operator / per segment: plain, checkpointed |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in results["rows"]:
        p, c = r["plain"], r["checkpointed"]
        cells = [f"{r['model']}", f"{r['batch']}", f"{c['flops'] / p['flops']:.3f}"]
        for how in ("per_operator", "per_segment"):
            cells.append(f"{p[how] * 1e3:.1f} / {c[how] * 1e3:.1f} ({c[how] / p[how]:.3f})")
        cells.append(f"{p['per_operator'] / p['per_segment']:.3f}, {c['per_operator'] / c['per_segment']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    out = Path(argv[0] if argv else ROOT / "bench" / "results")
    dev = profile(DEVICE)
    t0 = time.perf_counter()
    results = {"meta": {"command": "python -m bench.recompute_price", "date": time.strftime("%Y-%m-%d"),
                        "torch": torch.__version__, "device": dev.name, "seconds": 0.0},
               "rows": [price(name, batch, dev) for name, batch in CASES]}  # fmt: skip
    results["meta"]["seconds"] = round(time.perf_counter() - t0, 1)
    write_results(out, "recompute_price", results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
