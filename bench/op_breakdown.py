"""Where a CPU step's time goes, predicted and measured, by kind of operator: the evidence for what the
roofline misses (bench/plan_vs_reality_time.py).

Kinds: ``attention`` (SDPA kernels), ``matmul/conv`` (every other operator with FLOPs: mm, addmm, bmm,
convolutions), ``other`` (pointwise, normalization, reductions, the optimizer's arithmetic), and
``per-operator overhead`` (predicted: the profile's op_overhead per operator; measured: the step's time that
no operator's kernel accounts for: Python, modules, autograd, the dispatcher). Measured times come from
``torch.profiler`` (operators' self time, wall clock inside the operator) over one step, so they are shares
of that step's wall time (the profiler's own cost lands in the overhead), scaled to the median CPU time.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable

import numpy as np
from torch.profiler import ProfilerActivity, profile

from swap.capture import OP, Trace
from swap.devices import DeviceProfile
from swap.forecast.pricing import event_seconds

KINDS = ("matmul/conv", "attention", "other", "per-operator overhead")
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear")


def kind_of(name: str, has_flops: bool) -> str:
    if "attention" in name:
        return "attention"
    if has_flops or name in MATMUL or "conv" in name:
        return "matmul/conv"
    return "other"


def predicted(trace: Trace, dev: DeviceProfile) -> dict[str, float]:
    """Seconds per kind of the last iteration on ``dev`` (the overhead split out); pure."""
    b, e = trace.iterations()[-1]
    ops = np.flatnonzero(trace.op[b : e + 1] == OP) + b
    seconds = event_seconds(trace, dev)
    out = Counter({k: 0.0 for k in KINDS})
    for k in ops.tolist():
        out[kind_of(trace.op_name(k), trace.flops[k] > 0)] += float(seconds[k]) - dev.op_overhead
    out["per-operator overhead"] = dev.op_overhead * len(ops)
    return dict(out)


def measured(step: Callable[[], object], step_seconds: float) -> dict[str, float]:
    """Seconds per kind of one ``step()`` under the profiler, as shares of its wall time scaled to
    ``step_seconds``; what no operator's self time covers is the overhead."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
    out = Counter({k: 0.0 for k in KINDS})
    for ev in prof.key_averages():
        if ev.key.startswith("aten::"):
            out[kind_of(ev.key, False)] += ev.self_cpu_time_total / 1e6
    out["per-operator overhead"] = max(0.0, wall - sum(out.values()))
    scale = step_seconds / sum(out.values()) if sum(out.values()) > 0 else 0.0
    return {k: v * scale for k, v in out.items()}
