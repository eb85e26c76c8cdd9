"""What each event of a trace costs on a device: the per-operator roofline.

Note [Per-operator roofline]
Each operator takes max(its FLOPs / peak, its bytes / memory bandwidth) at the device's efficiency, plus
the profile's per-operator overhead (``DeviceProfile.step_seconds``), with the peak of its own precision
(a bf16 model's fp32 loss runs on the fp32 peak) and kind (an fp32 convolution on TF32 tensor cores, as cuDNN
runs it by default: Note [Peaks by precision and kind] in swap/devices.py). The step time is the sum over
operators, in the forward, the backward and any recompute alike.

Pricing sums instead (one roofline over all the operators between two saved-tensor events, which older
traces record) lets a compute-bound operator hide a memory-bound one and the other way round: the sum of
the maxima is at least the maximum of the sums, and the gap is largest where compute-heavy and memory-heavy
operators alternate, as in a checkpointed block's recompute (ResNet-50 checkpointed per
bottleneck priced 1.33x faster per segment than per operator on H100 figures, GPT-2 medium 1.22x).
Traces without operator events (format 5, imported snapshots) are still priced per segment, the best they
allow. Segments remain the unit of scheduling (swap.forecast.from_trace).

Note [Operator classes]
Two numbers per device are not enough on a CPU. On one core, PyTorch's pointwise kernels that compute per
element run far below the memory bandwidth of a multiply, each at its own rate (this machine, in bytes as the
capture counts them: max pooling's forward 0.9 GB/s, dropout's bernoulli_ 1.4, tanh 3.1, batch norm 4.3
forward and 17 backward, GELU 13, softmax 12, layer norm 21, against 36 for a multiply); CPU flash attention
reaches 17 GFLOP/s with 8-wide heads and 77 with 64-wide ones, against 100 for a matmul; and a small
convolution is slow for its FLOPs. A profile may therefore carry measured rates per operator class
(``DeviceProfile.class_rates``, ``attention_flops``): an operator of a class in ``OP_CLASSES`` then takes its
FLOPs at the class's FLOP/s plus its bytes at the class's bytes/s, plus the per-operator overhead, instead of
its roofline. Pointwise classes have no FLOPs. Convolutions pay both terms: on the calibration's 78
convolution calls (1x1 and 3x3, 16 to 256 channels, 8 to 64 pixels wide, a stem, strided ones, forward and
backward), one FLOP/s misses single calls by -81% to +31%, the two terms fitted (forward 109 GFLOP/s + 20
GB/s, backward 102 + 11) by -66% to +30%, 86% of them within 25%. CPU flash attention takes its FLOPs at the
rate of its head dim, interpolated in log2 of the head dim between the measured ones (clamped at the ends);
the head dim is not recorded, but the kernel's outputs give it (``attention_head_dim``), and where they do
not, the roofline prices it. The rates are measured on microbenchmarks of the classes' kernels
(bench/cpu_profile.py), never fitted to the models they are checked on. Only the CPU profile sets them: the
datasheet GPU profiles leave them unset and price every operator on the roofline exactly as before. A
function's forward and backward kernels are separate classes, since they run at different rates (batch norm's
forward at a quarter of its backward's) and a recompute reruns only forwards; the classes are what the
measured rates differ by, not a taxonomy, and an operator of no class keeps its roofline.

Fresh pages are the other cost a CPU step pays that no operator's bytes say: glibc serves an allocation of
``FRESH_PAGES_MIN`` (32 MiB, its largest mmap threshold on 64-bit) or more with fresh pages from the kernel
and returns them at free, so every such output is page-faulted and zeroed on first touch, in every step (this
machine: a multiply with a 64 MiB output runs at 5.9 GB/s out of place, 28 into a warm buffer, so fresh pages
come at 2.4 GB/s of output). With ``DeviceProfile.fresh_page_bandwidth`` set, the operator that returns
such an allocation (its alloc events follow it: Note [Trace file format]) pays its size at that bandwidth on
top.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from ..capture.trace import ALLOC, OP, Trace
from ..devices import OTHER, DeviceProfile, operator_kind


def low_precision_model(trace: Trace) -> bool:
    """Whether the trace's model trains in bf16/fp16 (what prices a trace that records no precision per
    operator)."""
    return trace.meta.get("dtype") in ("bfloat16", "float16")


# Note [Operator classes]: class -> its operators, as aten packet names.
OP_CLASSES: dict[str, tuple[str, ...]] = {
    "conv": ("aten.convolution",),
    "conv_backward": ("aten.convolution_backward",),
    "dropout": ("aten.bernoulli_", "aten.bernoulli", "aten.native_dropout"),
    "tanh": ("aten.tanh",),
    "tanh_backward": ("aten.tanh_backward",),
    "pow": ("aten.pow",),
    "gelu": ("aten.gelu",),
    "gelu_backward": ("aten.gelu_backward",),
    "silu": ("aten.silu",),
    "silu_backward": ("aten.silu_backward",),
    "softmax": ("aten._softmax", "aten._safe_softmax", "aten._log_softmax"),
    "softmax_backward": ("aten._softmax_backward_data", "aten._log_softmax_backward_data"),
    "layer_norm": ("aten.native_layer_norm",),
    "layer_norm_backward": ("aten.native_layer_norm_backward",),
    "group_norm": ("aten.native_group_norm",),
    "group_norm_backward": ("aten.native_group_norm_backward",),
    "batch_norm": ("aten.native_batch_norm", "aten._native_batch_norm_legit",
                   "aten._native_batch_norm_legit_functional", "aten._native_batch_norm_legit_no_training"),
    "batch_norm_backward": ("aten.native_batch_norm_backward",),
    "max_pool": ("aten.max_pool2d_with_indices",),
    "max_pool_backward": ("aten.max_pool2d_with_indices_backward",),
}  # fmt: skip
CLASS_OF = {name: cls for cls, names in OP_CLASSES.items() for name in names}
FRESH_PAGES_MIN = 32 << 20  # Note [Operator classes]: allocations glibc always maps fresh
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
    if lse < 4 or out <= 0 or (out // element) % (lse // 4):  # not a logsumexp of whole fp32 numbers
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
    seconds = dev.step_seconds(trace.flops, trace.bytes, precision, operator_kinds(trace))
    if (dev.class_rates or dev.attention_flops or dev.fresh_page_bandwidth) and trace.has_ops():
        seconds = _at_class_rates(trace, dev, seconds)
    return np.where(costly, seconds, 0.0)


def tf32_note(dev: DeviceProfile, setting: Any) -> str:
    """What ``dev`` assumes of fp32 convolutions and matmuls, in words, for a plan's notes."""
    mode = {True: "TF32", False: "fp32"}
    why = "PyTorch's flags now" if setting in (None, "auto") else f"tf32={setting!r}"
    return (f"fp32 convolutions priced in {mode[dev.tf32_conv]}, fp32 matmuls in {mode[dev.tf32_matmul]} ({why}; "
            "tf32='on' / 'off' or --tf32 to choose)")  # fmt: skip


def operator_kinds(trace: Trace) -> np.ndarray:
    """Each event's operator kind (``swap.devices.operator_kind``; OTHER for events that are not operators)."""
    names = trace.meta.get("ops", [])
    if not names:
        return np.full(len(trace), OTHER)
    by_id = np.array([operator_kind(n) for n in names])
    return np.where(trace.op == OP, by_id[np.clip(trace.id, 0, len(names) - 1)], OTHER)


def class_seconds(flops: Any, nbytes: Any, rates: tuple[float, float]) -> Any:
    """Seconds of operators of a class with measured ``rates`` (FLOP/s, bytes/s; 0: no such term), without
    the per-operator overhead (Note [Operator classes])."""
    flop_rate, byte_rate = rates
    return (np.divide(flops, flop_rate) if flop_rate else 0.0) + (np.divide(nbytes, byte_rate) if byte_rate else 0.0)


def _at_class_rates(trace: Trace, dev: DeviceProfile, roofline: np.ndarray) -> np.ndarray:
    """``roofline`` with the operators of the profile's measured classes priced at their rates, and the fresh
    pages of large outputs added to the operators that return them."""
    names = [packet(n) for n in trace.meta["ops"]]
    rates = dev.class_rates or {}
    seconds = roofline.copy()
    is_op = trace.op == OP
    for i, name in enumerate(names):
        cls = CLASS_OF.get(name)
        if cls in rates:
            at = is_op & (trace.id == i)
            seconds[at] = class_seconds(trace.flops[at], trace.bytes[at], rates[cls]) + dev.op_overhead
    if dev.attention_flops:
        ids = [i for i, name in enumerate(names) if name in (ATTENTION, ATTENTION_BACKWARD)]
        for k in np.flatnonzero(is_op & np.isin(trace.id, ids)).tolist():
            d = attention_head_dim(trace, k)
            if d is not None:  # else its roofline, as before
                seconds[k] = trace.flops[k] / attention_rate(d, dev.attention_flops) + dev.op_overhead
    if dev.fresh_page_bandwidth:
        fresh = np.flatnonzero((trace.op == ALLOC) & (trace.size >= FRESH_PAGES_MIN))
        returned_by = np.maximum.accumulate(np.where(is_op, np.arange(len(trace)), -1))[fresh]
        by_op = returned_by >= 0  # else made outside the captured operators (parameters)
        np.add.at(seconds, returned_by[by_op], trace.size[fresh[by_op]] / dev.fresh_page_bandwidth)
    return seconds


def iteration_seconds(trace: Trace, dev: DeviceProfile, iteration: int = -1) -> float:
    """The compute seconds of one iteration (default: the last), every event priced."""
    b, e = trace.iterations()[iteration]
    return float(event_seconds(trace, dev)[b : e + 1].sum())
