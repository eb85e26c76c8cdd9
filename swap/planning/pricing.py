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

Note [Operator classes]
Two numbers per device are not enough on a CPU. On one core, PyTorch's pointwise kernels that compute per
element run far below the memory bandwidth of a multiply, each at its own rate (this machine, forward and
backward kernels together, bytes as the capture counts them: dropout's bernoulli_ 1.4 GB/s, tanh 6.9, batch
norm 7.9, GELU 13, softmax 20, layer norm 21, against 45 for a multiply); CPU flash attention reaches 17
GFLOP/s with 8-wide heads and 79 with 64-wide ones, against 93 for a matmul. A profile may therefore carry
measured rates per operator class (``DeviceProfile.class_rates``, ``attention_flops``): an operator of a
class in ``OP_CLASSES`` then takes its bytes (or FLOPs) at the class's rate, plus the per-operator overhead,
instead of its roofline; CPU flash attention takes its FLOPs at the rate of its head dim, interpolated in
log2 of the head dim between the measured ones (clamped at the ends). The head dim is not recorded, but the
kernel's outputs give it (``attention_head_dim``); where they do not, the roofline prices it. Convolutions
are a class too, although on the calibration's shapes they reach about the matmul's rate (98 GFLOP/s).
The rates are measured on microbenchmarks of the classes' kernels (bench/cpu_profile.py), never fitted to the
models they are checked on. Only the CPU profile sets them: the datasheet GPU profiles leave them unset and
price every operator on the roofline exactly as before. A class is a function's forward and backward kernels,
priced by one rate: the classes are what the measured rates differ by, not a taxonomy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np

from ..capture.trace import ALLOC, OP, Trace
from .devices import DeviceProfile


def low_precision_model(trace: Trace) -> bool:
    """Whether the trace's model trains in bf16/fp16 (what prices a trace that records no precision per
    operator)."""
    return trace.meta.get("dtype") in ("bfloat16", "float16")


BYTES, FLOPS = "bytes", "flops"
# Note [Operator classes]: class -> (what its rate counts, the operators, as aten packet names).
OP_CLASSES: dict[str, tuple[str, tuple[str, ...]]] = {
    "conv": (FLOPS, ("aten.convolution", "aten.convolution_backward")),
    "dropout": (BYTES, ("aten.bernoulli_", "aten.bernoulli", "aten.native_dropout")),
    "tanh": (BYTES, ("aten.tanh", "aten.tanh_backward")),
    "pow": (BYTES, ("aten.pow",)),
    "gelu": (BYTES, ("aten.gelu", "aten.gelu_backward")),
    "silu": (BYTES, ("aten.silu", "aten.silu_backward")),
    "softmax": (BYTES, ("aten._softmax", "aten._safe_softmax", "aten._softmax_backward_data", "aten._log_softmax",
                        "aten._log_softmax_backward_data")),
    "layer_norm": (BYTES, ("aten.native_layer_norm", "aten.native_layer_norm_backward")),
    "group_norm": (BYTES, ("aten.native_group_norm", "aten.native_group_norm_backward")),
    "batch_norm": (BYTES, ("aten.native_batch_norm", "aten.native_batch_norm_backward",
                           "aten._native_batch_norm_legit", "aten._native_batch_norm_legit_functional",
                           "aten._native_batch_norm_legit_no_training")),
}  # fmt: skip
CLASS_OF = {name: cls for cls, (_, names) in OP_CLASSES.items() for name in names}
ATTENTION, ATTENTION_BACKWARD = ("aten._scaled_dot_product_flash_attention_for_cpu",
                                 "aten._scaled_dot_product_flash_attention_for_cpu_backward")  # fmt: skip


def packet(op_name: str) -> str:
    """The operator's packet name without its overload ("aten.tanh.default" -> "aten.tanh")."""
    return op_name.rsplit(".", 1)[0]


def attention_head_dim(trace: Trace, k: int) -> Optional[int]:
    """The head dim of CPU flash attention event ``k``, from the allocations it returns (they follow it: Note
    [Trace file format]): the forward returns the output (B, H, L, d) and the fp32 logsumexp (B, H, L); the
    backward returns the gradients of q, k and v, and read grad_out, q, k, v, the output (q's size each) and
    the logsumexp, so the logsumexp's bytes are what its moved bytes leave. None when the events do not say."""
    sizes = []
    j = k + 1
    while j < len(trace) and trace.op[j] == ALLOC:
        sizes.append(int(trace.size[j]))
        j += 1
    element = 2 if trace.precision[k] == 1 else 4
    name = packet(trace.op_name(k))
    if name == ATTENTION and len(sizes) == 2:
        out, lse = sizes
    elif name == ATTENTION_BACKWARD and len(sizes) == 3:
        out, lse = sizes[0], int(trace.bytes[k]) - 4 * sizes[0] - 2 * sizes[1] - 2 * sizes[2]
    else:
        return None
    if lse <= 0 or out <= 0 or (out // element) % (lse // 4):
        return None
    return (out // element) // (lse // 4)


def attention_rate(head_dim: int, measured: Sequence[tuple[int, float]]) -> float:
    """FLOP/s of CPU flash attention at ``head_dim``: the measured (head dim, FLOP/s) pairs interpolated in
    log2 of the head dim, clamped at the ends (Note [Operator classes])."""
    dims, rates = zip(*sorted(measured))
    return float(np.interp(np.log2(head_dim), np.log2(dims), rates))


def event_seconds(trace: Trace, dev: DeviceProfile, low_precision: Optional[bool] = None) -> np.ndarray:
    """Seconds of each event of ``trace`` on ``dev`` (Note [Per-operator roofline]): operator events on the
    roofline of their own precision, or at their class's measured rate where ``dev`` has one (Note [Operator
    classes]); the segment sums of older traces on the model's precision (``low_precision``, default from
    the trace's dtype); 0 for events that cost nothing."""
    low = low_precision_model(trace) if low_precision is None else low_precision
    precision = np.where(trace.precision >= 0, trace.precision == 1, low)
    costly = (trace.op == OP) | (trace.flops > 0) | (trace.bytes > 0)
    seconds = dev.step_seconds(trace.flops, trace.bytes, precision)
    if (dev.class_rates or dev.attention_flops) and trace.has_ops():
        seconds = _at_class_rates(trace, dev, seconds)
    return np.where(costly, seconds, 0.0)


def _at_class_rates(trace: Trace, dev: DeviceProfile, roofline: np.ndarray) -> np.ndarray:
    """``roofline`` with the operators of the profile's measured classes priced at their rates."""
    names = [packet(n) for n in trace.meta["ops"]]
    rates, units = dev.class_rates or {}, {cls: unit for cls, (unit, _) in OP_CLASSES.items()}
    seconds = roofline.copy()
    is_op = trace.op == OP
    for i, name in enumerate(names):
        cls = CLASS_OF.get(name)
        if cls is None or cls not in rates:
            continue
        at = is_op & (trace.id == i)
        work = trace.flops[at] if units[cls] == FLOPS else trace.bytes[at]
        seconds[at] = work / rates[cls] + dev.op_overhead
    if dev.attention_flops:
        ids = [i for i, name in enumerate(names) if name in (ATTENTION, ATTENTION_BACKWARD)]
        for k in np.flatnonzero(is_op & np.isin(trace.id, ids)).tolist():
            d = attention_head_dim(trace, k)
            if d is not None:  # else its roofline, as before
                seconds[k] = trace.flops[k] / attention_rate(d, dev.attention_flops) + dev.op_overhead
    return seconds


def iteration_seconds(trace: Trace, dev: DeviceProfile, iteration: int = -1) -> float:
    """The compute seconds of one iteration (default: the last), every event priced."""
    b, e = trace.iterations()[iteration]
    return float(event_seconds(trace, dev)[b : e + 1].sum())
