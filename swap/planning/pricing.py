"""What each event of a trace costs on a device: the per-operator roofline.

Note [Per-operator roofline]
Each operator takes max(its FLOPs / peak, its bytes / memory bandwidth) at the device's efficiency, plus
the profile's per-operator overhead (``DeviceProfile.step_seconds``), with the peak of its own precision
(a bf16 model's fp32 loss runs on the fp32 peak). The step time is the sum over operators, in the forward,
the backward and any recompute alike.

Pricing sums instead (one roofline over all the operators between two saved-tensor events, which older
traces record) lets a compute-bound operator hide a memory-bound one and the other way round: the sum of
the maxima is at least the maximum of the sums, and the gap is largest where compute-heavy and memory-heavy
operators alternate, as in a checkpointed block's recompute (issue 21: ResNet-50 checkpointed per
bottleneck priced 1.33x faster per segment than per operator on H100 figures, GPT-2 medium 1.22x).
Traces without operator events (format 5, imported snapshots) are still priced per segment, the best they
allow. Segments remain the unit of scheduling (swap.planning.from_trace).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..capture.trace import OP, Trace
from .devices import DeviceProfile


def low_precision_model(trace: Trace) -> bool:
    """Whether the trace's model trains in bf16/fp16 (what prices a trace that records no precision per
    operator)."""
    return trace.meta.get("dtype") in ("bfloat16", "float16")


def event_seconds(trace: Trace, dev: DeviceProfile, low_precision: Optional[bool] = None) -> np.ndarray:
    """Seconds of each event of ``trace`` on ``dev`` (Note [Per-operator roofline]): operator events on the
    roofline of their own precision; the segment sums of older traces on the model's precision
    (``low_precision``, default from the trace's dtype); 0 for events that cost nothing."""
    low = low_precision_model(trace) if low_precision is None else low_precision
    precision = np.where(trace.precision >= 0, trace.precision == 1, low)
    costly = (trace.op == OP) | (trace.flops > 0) | (trace.bytes > 0)
    seconds = dev.step_seconds(trace.flops, trace.bytes, precision)
    return np.where(costly, seconds, 0.0)


def iteration_seconds(trace: Trace, dev: DeviceProfile, iteration: int = -1) -> float:
    """The compute seconds of one iteration (default: the last), every event priced."""
    b, e = trace.iterations()[iteration]
    return float(event_seconds(trace, dev)[b : e + 1].sum())
