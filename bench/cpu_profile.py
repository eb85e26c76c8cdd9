"""A device profile of this machine's CPU, calibrated from measurements, for checking the planner's clock.

    python -m bench.cpu_profile        # ~2 minutes; writes bench/results/cpu_profile.json

Note [The CPU as a device]
The planner prices each operator on a roofline (Note [Per-operator roofline] in swap/forecast/pricing.py)
with a device's peak FLOP/s, memory bandwidth and per-operator overhead. On a GPU these come from the
datasheet (and ``--profile`` corrects them from a run); here every figure is measured, once, on the machine
that trains, with PyTorch's own kernels and thread count:

- ``matmul_flops``: FLOP/s of fp32 ``torch.mm`` at 1024 x 1024 x 1024 (2 n^3 FLOPs; median of repeats). The
  CPU has no low-precision tensor cores worth a separate peak: bf16/fp16 operators get the same figure.
- ``mem_bandwidth``: bytes/s of ``torch.mul(a, b)`` counting what the capture counts for it (two inputs read,
  one output written), on 8 MiB tensors (the size of the benchmark models' activations), each multiply on
  the next of pairs cycled through ``COLD_BYTES``: a training step's operands come from memory, while one
  pair in a hot loop stays in the L3 cache (calibrated that way, 57.8 GB/s), out of place: a
  training step's operators allocate their outputs, and fresh memory costs page faults that an ``out=``
  kernel into a warm buffer does not pay (1 thread, this machine: 39 GB/s out of place, 54 GB/s with
  ``out=``; at 32 MiB, past glibc's mmap threshold, 5.6 against 30).
- ``op_overhead``: seconds per operator beyond its roofline (Python, module calls, the dispatcher, autograd's
  nodes and engine, the optimizer's loop): a training step of a model so small that its roofline is
  negligible (a stack of 8-wide Linear/GELU/LayerNorm layers, AdamW), measured, less its roofline, divided by
  the number of operators its capture records.
- ``runtime_op_overhead``: what ``SwapManager`` adds per operator on CPU (the ``LiveBytesMeter`` dispatch mode
  that measures the budget, and its saved-tensor hooks): the same small step under a manager whose budget the
  step fits (it profiles, then steps aside with its meter still on), less the plain step, per operator.
- ``runtime_save_overhead`` and ``runtime_copy_bandwidth``: what a *planned, swapping* step adds beyond the
  per-operator cost: seconds per copy the schedule issues (each swap-out and each swap-in of a saved tensor)
  and the bytes per second at which the runtime's copies are paid for (Note [The runtime's cost per copy]).
- ``link_bandwidth``: the CPU has no copy engine. ``SwapManager`` on CPU "swaps" into host blocks in the same
  memory, with ``dst.copy_(src)`` on a worker thread that competes with the compute threads for the cores.
  The link is that memcpy: bytes/s of ``copy_`` of 8 MiB tensors, cycled like the multiply's (counting each
  byte once, as the runtime's swapped-bytes counters do). A swapped step is predicted as its compute plus
  every copied byte at this bandwidth, serially (bench/plan_vs_reality_time.py), not as copies hidden
  behind compute.
- ``class_rates``: the achieved rates of each operator class of Note [Operator classes] (swap/forecast/pricing.py),
  where the roofline's two numbers are not enough on a CPU (``fit_rates``): bytes/s (as the capture counts
  them: tensors read and written) of each pointwise class's forward and backward kernels on 1, 4 and 16 MiB
  inputs, total bytes over total time; FLOP/s (the capture's formulas) and bytes/s of convolutions forward
  and backward (``CONVS``), fitted.
- ``attention_flops``: FLOP/s of CPU flash attention (SDPA's kernel on CPU) forward + backward by head dim,
  8 to 128, at 256 and 1024 tokens.
- ``fresh_page_bandwidth``: the output bytes per second of fresh pages, from a multiply with a 64 MiB output
  (past glibc's mmap threshold) timed out of place and into a warm buffer (``out=``): the difference is the
  page faults and zeroing that every such allocation pays (Note [Operator classes]).

Every time is the median of 3 calibration rounds (``--rounds``; each the median of its repeats): on this
shared machine one round's matmul came out 91 and another's 101 GFLOP/s.

The microbenchmarks are generic shapes chosen here, not the models that bench/plan_vs_reality_time.py checks
the profile on: nothing is fitted to those.

Everything runs on one intra-op thread (``THREADS``), the calibration and the runs it predicts alike: this
machine is shared (a load of 6 on 2 cores is common), and with two OpenMP threads every parallel region
waits at its barrier for whichever thread the kernel descheduled, so the same step took 0.2 s or 4 s (GPT-2
quick: five plain steps 4.9, 4.6, 2.2, 2.0, 2.0 s; on one thread 0.14, 0.11, 0.10, 0.09, 0.09 s).

Times are CPU time of the process (``time.process_time``), not wall time: other engineers' jobs share the
cores, and the time the kernel gives them is not the step's (bench/swap_overhead.py, Note [CPU time, not wall
time]). A swapped step's copy workers are counted in it, which is what Note [Copies on a CPU] in
bench/plan_vs_reality_time.py predicts.

Note [The runtime's cost per copy]
A planned step does per saved tensor what a declined one does not: the executor queues its swap-out on the
copy worker (a host block from the pool, a job handed to another thread, an event to wait on), releases it,
queues its swap-in ahead of its use (a fresh tensor) and the unpack hook waits for it
(bench/results/swap_overhead.md: tens of µs per pack and per unpack on CPU). It is measured on MLPs
(``SAVE_MLPS``, not the checked models) whose budget (a fifth of the way from the least any schedule needs
to the unswapped peak) makes the window schedule swap most saved tensors: the planned step less the plain
step less the per-operator cost (``runtime_op_overhead``) of its operators, fitted as ``copies x seconds per
copy + bytes copied / bytes per second`` over three MLPs whose copies (42, 84) and tensor sizes (256 KiB to
1 MiB) vary apart (``fit_copy_costs``). The unit is the copy, not the tensor: each swap-out and each swap-in
is one job on the worker with its own hand-off and wait, and a schedule may swap a tensor out without
bringing it back in the step (a ResNet's window schedule copies out more than in), so the cost follows
``len(swap_out) + len(swap_in)`` of the schedule. Both terms are needed: the runtime's copies land in host
blocks and in fresh tensors, with the worker's CPU time counted in the step, which a bare ``copy_`` between
warm tensors does not show (one run, ``python -m bench.cpu_profile``, 3 rounds: 97.6 µs per copy, bytes at
9.95 GB/s against memcpy's 14.3; the fit's three steps 5.20 / 3.77, 8.52 / 7.81, 12.77 / 13.83 ms predicted /
measured: the per-operator figure subtracted, 13 µs, is itself noisy at this scale). A swapped step is
therefore predicted with its copies at ``runtime_save_overhead`` each and their bytes at
``runtime_copy_bandwidth`` (bench/plan_vs_reality_time.py, ``swapped_seconds``). Saved tensors that a
planned step keeps still run the hooks; they are few at this budget, so their cost is folded into the
copies' and not priced apart.

``profile_from`` (pure: measurements in, profile out) turns the figures into a ``DeviceProfile`` at
efficiency 1 (the rates are what the kernels reached, not peaks to be scaled).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import itertools
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn as nn

import swap
from swap.capture import capture
from swap.capture.flops import operator_flops
from swap.capture.traffic import moved_bytes
from swap.devices import DeviceProfile
from swap.forecast.pricing import CLASS_OF, FRESH_PAGES_MIN, OP_CLASSES, iteration_seconds, packet

ROOT = Path(__file__).resolve().parents[1]
PATH = ROOT / "bench" / "results" / "cpu_profile.json"
MiB = 1 << 20
MATMUL_N = 1024
TENSOR_BYTES = 8 * MiB
COLD_BYTES = 256 * MiB  # operands cycled through, 8x this machine's 32 MiB L3: each kernel reads memory
TINY_WIDTH, TINY_LAYERS, TINY_BATCH = 8, 16, 2
THREADS = 1  # Note [The CPU as a device]: one intra-op thread, for steady timings on a shared machine
POINTWISE_MIB = (1, 4, 16)  # input sizes of the pointwise classes' microbenchmarks
# Note [The runtime's cost per copy]: (width, Linear+GELU layers) of MLPs on a batch of SAVE_BATCH, whose
# saved tensors (256 KiB to 1 MiB) are all above SAVE_MIN_BYTES and dominate the step's memory
SAVE_MLPS, SAVE_BATCH, SAVE_MIN_BYTES = ((32, 12), (128, 12), (64, 24)), 2048, 32 * 1024
HEAD_DIMS, ATTENTION_TOKENS = (8, 16, 32, 64, 128), (256, 1024)
aten = torch.ops.aten


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class CpuMeasurements:
    """What was measured (seconds are medians of repeats)."""

    matmul_n: int
    matmul_seconds: float  # one n x n x n fp32 matmul
    mul_bytes: int  # bytes of each operand of the (out-of-place) multiply
    mul_seconds: float
    copy_bytes: int
    copy_seconds: float
    tiny_ops: int  # operators the capture records in one step of the tiny model
    tiny_roofline_seconds: float  # their roofline on the measured rates, without overhead
    tiny_step_seconds: float  # one step, plain
    tiny_managed_step_seconds: float  # one step under SwapManager (declined: meter and hooks on)
    threads: int
    memory: int  # bytes of the machine's memory
    # per operator class (Note [Operator classes]): (FLOPs, bytes, seconds) of each of its microbenchmark
    # calls; CPU flash attention by head dim: (FLOPs, seconds) summed over its calls
    classes: dict[str, list[tuple[float, float, float]]] = dataclasses.field(default_factory=dict)
    attention: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)
    # a multiply with a large output (past glibc's mmap threshold): out of place, and into a warm buffer
    fresh_bytes: int = 0  # bytes of its output
    fresh_seconds: float = 0.0
    warm_seconds: float = 0.0
    # the MLPs of Note [The runtime's cost per copy] (SAVE_MLPS): (operators, copies and bytes copied per
    # planned step, seconds of a plain step, seconds of a planned, swapping step)
    swap_steps: list[tuple[int, int, int, float, float]] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class CpuProfile:
    """The CPU as a device (Note [The CPU as a device]): the roofline's figures, and the copy 'link' and the
    swap runtime's per-operator cost, which only a swapped run pays."""

    device: DeviceProfile
    link_bandwidth: float  # bytes/s of the runtime's host copies (memcpy, competing with compute)
    runtime_op_overhead: float  # seconds per operator that SwapManager's meter and hooks add on CPU
    # Note [The runtime's cost per copy]; the defaults (profiles from before them): copies cost the link's rate
    runtime_save_overhead: float = 0.0  # seconds per copy (swap-out or swap-in) of a planned step
    runtime_copy_bandwidth: float = 0.0  # bytes/s of a planned step's copies; 0: link_bandwidth

    @property
    def copy_bandwidth(self) -> float:
        """Bytes/s at which a planned step's copies cost (Note [The runtime's cost per copy])."""
        return self.runtime_copy_bandwidth or self.link_bandwidth

    def to_json(self) -> dict[str, Any]:
        return {"device": dataclasses.asdict(self.device), "link_bandwidth": self.link_bandwidth,
                "runtime_op_overhead": self.runtime_op_overhead,
                "runtime_save_overhead": self.runtime_save_overhead,
                "runtime_copy_bandwidth": self.runtime_copy_bandwidth}  # fmt: skip

    @staticmethod
    def from_json(d: dict[str, Any]) -> CpuProfile:
        device = dict(d["device"])
        device["attention_flops"] = tuple((int(h), float(r)) for h, r in device.get("attention_flops", ()))
        if device.get("class_rates"):
            device["class_rates"] = {cls: (float(f), float(b)) for cls, (f, b) in device["class_rates"].items()}
        return CpuProfile(DeviceProfile(**device), float(d["link_bandwidth"]), float(d["runtime_op_overhead"]),
                          float(d.get("runtime_save_overhead", 0.0)), float(d.get("runtime_copy_bandwidth", 0.0)))


def rates(m: CpuMeasurements) -> tuple[float, float]:
    """(matmul FLOP/s, memory bytes/s) of the measurements."""
    if min(m.matmul_seconds, m.mul_seconds, m.copy_seconds) <= 0:
        raise ValueError(f"measured times must be positive: {m}")
    return 2 * m.matmul_n**3 / m.matmul_seconds, 3 * m.mul_bytes / m.mul_seconds


def fit_rates(calls: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(FLOP/s, bytes/s) of a class from its calls' (FLOPs, bytes, seconds) (Note [Operator classes]); pure.
    Without FLOPs: total bytes over total time, so slow kernels weigh as they cost. With FLOPs: seconds =
    FLOPs / F + bytes / B fitted in relative error over the calls; where a term comes out negative, FLOPs alone,
    total over total."""
    flops, nbytes, seconds = (np.array(column, dtype=float) for column in zip(*calls))
    if not flops.any():
        return 0.0, float(nbytes.sum() / seconds.sum())
    inverse, *_ = np.linalg.lstsq(np.stack([flops, nbytes], 1) / seconds[:, None], np.ones(len(seconds)), rcond=None)
    if min(inverse) <= 0:
        return float(flops.sum() / seconds.sum()), 0.0
    return float(1 / inverse[0]), float(1 / inverse[1])


def fit_errors(calls: list[tuple[float, float, float]], rates: tuple[float, float]) -> np.ndarray:
    """(predicted - measured) / measured seconds of each call on ``rates`` (FLOP/s, bytes/s; 0: no term)."""
    flops, nbytes, seconds = (np.array(column, dtype=float) for column in zip(*calls))
    predicted = (flops / rates[0] if rates[0] else 0.0) + (nbytes / rates[1] if rates[1] else 0.0)
    return predicted / seconds - 1


def class_rates(m: CpuMeasurements) -> tuple[dict[str, tuple[float, float]], tuple[tuple[int, float], ...]]:
    """(rates per operator class, (head dim, FLOP/s) of CPU flash attention) of the measurements."""
    for what, timed in [*m.classes.items(), *m.attention.items()]:
        calls = timed if what in m.classes else [timed]
        if not calls or min(call[-1] for call in calls) <= 0 or min(min(call) for call in calls) < 0:
            raise ValueError(f"{what}: measured times must be positive and work not negative, got {timed}")
    unknown = set(m.classes) - set(OP_CLASSES)
    if unknown:
        raise ValueError(f"no operator class {sorted(unknown)} in swap.forecast.pricing.OP_CLASSES")
    rates = {cls: fit_rates(calls) for cls, calls in m.classes.items()}
    return rates, tuple((h, flops / seconds) for h, (flops, seconds) in sorted(m.attention.items()))


def copy_costs(m: CpuMeasurements, runtime_op_overhead: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(copies, bytes copied, seconds the runtime adds for them) of each of ``m.swap_steps``: the planned step
    less the plain one less the per-operator cost (Note [The runtime's cost per copy]); pure."""
    rows = []
    for ops, copies, nbytes, plain, swapped in m.swap_steps:
        if copies <= 0 or nbytes <= 0 or min(plain, swapped) <= 0:
            raise ValueError(f"a swapping step must copy and take time, got {copies} copies of {nbytes} bytes, "
                             f"{plain} s plain, {swapped} s planned")  # fmt: skip
        rows.append((copies, nbytes, swapped - plain - ops * runtime_op_overhead))
    copies, nbytes, seconds = (np.array(column, dtype=float) for column in zip(*rows))
    return copies, nbytes, seconds


def fit_copy_costs(m: CpuMeasurements, runtime_op_overhead: float) -> tuple[float, float]:
    """(seconds per copy, bytes/s) of the runtime's copies, least squares over ``m.swap_steps`` (Note [The
    runtime's cost per copy]); pure. A term that comes out negative (noise) is dropped and the other fitted
    alone; (0, 0) when nothing was measured or nothing is left to price."""
    if not m.swap_steps:
        return 0.0, 0.0
    copies, nbytes, seconds = copy_costs(m, runtime_op_overhead)
    if seconds.sum() <= 0:
        return 0.0, 0.0
    (per_copy, per_byte), *_ = np.linalg.lstsq(np.stack([copies, nbytes], 1), seconds, rcond=None)
    if per_byte <= 0:
        return float(seconds.sum() / copies.sum()), 0.0
    if per_copy < 0:
        return 0.0, float(nbytes.sum() / seconds.sum())
    return float(per_copy), float(1 / per_byte)


def profile_from(m: CpuMeasurements, name: str = "cpu") -> CpuProfile:
    """The CPU profile the measurements imply (Note [The CPU as a device]); pure. ``tiny_roofline_seconds``
    must be the tiny step's roofline on ``rates(m)``; overheads below zero (noise) count as 0."""
    if m.tiny_ops <= 0:
        raise ValueError(f"the tiny step recorded no operators ({m.tiny_ops}): nothing to calibrate the overhead on")
    flops, bandwidth = rates(m)
    op_overhead = max(0.0, (m.tiny_step_seconds - m.tiny_roofline_seconds) / m.tiny_ops)
    runtime = max(0.0, (m.tiny_managed_step_seconds - m.tiny_step_seconds) / m.tiny_ops)
    link = m.copy_bytes / m.copy_seconds
    per_copy, copy_bandwidth = fit_copy_costs(m, runtime)
    rates_of_classes, attention = class_rates(m)
    first_touch = m.fresh_seconds - m.warm_seconds  # 0 or less: fresh pages cost nothing measurable
    fresh_pages = m.fresh_bytes / first_touch if m.fresh_bytes and first_touch > 0 else 0.0
    device = DeviceProfile(
        f"{name}, {m.threads} threads (measured)", flops, flops, bandwidth, link, link, m.memory, efficiency=1.0,
        source=f"measured by python -m bench.cpu_profile: fp32 mm {m.matmul_n}^3, mul and copy_ of "
               f"{m.mul_bytes // MiB} MiB tensors, a {TINY_LAYERS}-layer {TINY_WIDTH}-wide training step; "
               f"operator classes and attention on microbenchmarks",
        op_overhead=op_overhead, class_rates=rates_of_classes or None, attention_flops=attention,
        fresh_page_bandwidth=fresh_pages,
    )  # fmt: skip
    return CpuProfile(device, link, runtime, per_copy, copy_bandwidth)


def load(path: Path = PATH) -> CpuProfile:
    """The committed calibration (``python -m bench.cpu_profile`` writes it)."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path}: no CPU profile; calibrate one with `python -m bench.cpu_profile`")
    return CpuProfile.from_json(json.loads(Path(path).read_text())["profile"])


# -- measuring ----------------------------------------------------------------------------------------------
def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def time_calls(calls: list[tuple[Any, tuple]], repeats: int) -> list[tuple[float, float, float]]:
    """(FLOPs, bytes, seconds) of each of ``calls`` of (aten overload, args), FLOPs and bytes as the capture
    counts them, seconds the median of repeats."""
    out = []
    for func, args in calls:
        result = func(*args)
        seconds = median_seconds(functools.partial(func, *args), repeats)
        out.append((operator_flops(func, args, {}, result), float(moved_bytes(func, args, {}, result)), seconds))
    return out


def pointwise_calls(cls: str, mib: int) -> list[tuple[Any, tuple]]:
    """The forward and backward kernels of a pointwise family (``FAMILIES``) on ``mib`` MiB fp32 inputs."""
    n = mib * MiB // 4
    x, g = torch.randn(n), torch.randn(n)
    rows = x.view(-1, 1024)
    if cls == "dropout":  # CPU dropout draws its mask with bernoulli_ (then div_ and mul: memory-bound)
        return [(aten.bernoulli_.float, (torch.empty(n), 0.9))]
    if cls == "tanh":
        return [(aten.tanh.default, (x,)), (aten.tanh_backward.default, (g, torch.tanh(x)))]
    if cls == "pow":
        return [(aten.pow.Tensor_Scalar, (x, 3.0))]
    if cls in ("gelu", "silu"):
        fwd, bwd = getattr(aten, cls).default, getattr(aten, f"{cls}_backward").default
        return [(fwd, (x,)), (bwd, (g, x))]
    if cls == "softmax":
        y, logy = torch.softmax(rows, -1), torch.log_softmax(rows, -1)
        return [(aten._softmax.default, (rows, -1, False)), (aten._log_softmax.default, (rows, -1, False)),
                (aten._softmax_backward_data.default, (g.view_as(rows), y, -1, torch.float32)),
                (aten._log_softmax_backward_data.default, (g.view_as(rows), logy, -1, torch.float32))]  # fmt: skip
    if cls == "layer_norm":
        w, b = torch.ones(1024), torch.zeros(1024)
        _, mean, rstd = aten.native_layer_norm.default(rows, [1024], w, b, 1e-5)
        return [(aten.native_layer_norm.default, (rows, [1024], w, b, 1e-5)),
                (aten.native_layer_norm_backward.default, (g.view_as(rows), rows, [1024], mean, rstd, w, b,
                                                           [True, True, True]))]  # fmt: skip
    images, c = x.view(8, 64, -1), 64  # batch 8, 64 channels
    w, b = torch.ones(c), torch.zeros(c)
    if cls == "group_norm":
        hw = images.shape[-1]
        _, mean, rstd = aten.native_group_norm.default(images, w, b, 8, c, hw, 32, 1e-5)
        return [(aten.native_group_norm.default, (images, w, b, 8, c, hw, 32, 1e-5)),
                (aten.native_group_norm_backward.default, (g.view_as(images), images, mean, rstd, w, 8, c, hw, 32,
                                                           [True, True, True]))]  # fmt: skip
    if cls == "batch_norm":
        rm, rv = torch.zeros(c), torch.ones(c)
        _, mean, invstd = aten.native_batch_norm.default(images, w, b, rm, rv, True, 0.1, 1e-5)
        return [(aten.native_batch_norm.default, (images, w, b, rm, rv, True, 0.1, 1e-5)),
                (aten.native_batch_norm_backward.default, (g.view_as(images), images, w, rm, rv, mean, invstd, True,
                                                           1e-5, [True, True, True]))]  # fmt: skip
    if cls == "max_pool":
        size = round((n // (8 * 64)) ** 0.5)  # square images of about mib MiB, batch 8, 64 channels
        pool = (torch.randn(8, 64, size, size), [3, 3], [2, 2], [1, 1])
        out, indices = aten.max_pool2d_with_indices.default(*pool)
        return [(aten.max_pool2d_with_indices.default, pool),
                (aten.max_pool2d_with_indices_backward.default, (torch.randn_like(out), *pool, [1, 1], False,
                                                                 indices))]  # fmt: skip
    raise ValueError(f"no microbenchmark for operator family {cls!r}")


# (in, out channels, kernel, stride, pixels wide): 1x1 and 3x3 on a grid of channels and sizes, an image
# model's 7x7 stride-2 stem on 3 channels, 3x3 stride-2 downsampling; batch 8
GRID = [(c, c, k, 1, size) for k in (1, 3) for c in (16, 32, 64, 128, 256) for size in (8, 16, 32, 64)]
CONVS = [conv for conv in GRID if conv[0] * conv[4] ** 2 <= 256 * 32 * 32] + [
    (3, 64, 7, 2, 128), (64, 64, 3, 2, 64), (128, 128, 3, 2, 32)]  # fmt: skip


def conv_calls() -> list[tuple[Any, tuple]]:
    """Convolutions (``CONVS``) forward and backward."""
    calls = []
    for c_in, c_out, k, stride, size in CONVS:
        x, w = torch.randn(8, c_in, size, size), torch.randn(c_out, c_in, k, k)
        conv = (x, w, None, [stride] * 2, [k // 2] * 2, [1, 1], False, [0, 0], 1)
        grad = aten.convolution.default(*conv)
        backward = (grad, *conv[:2], [c_out], *conv[3:], [True, True, True])
        calls += [(aten.convolution.default, conv), (aten.convolution_backward.default, backward)]
    return calls


FAMILIES = ("conv", "dropout", "tanh", "pow", "gelu", "silu", "softmax", "layer_norm", "group_norm", "batch_norm",
            "max_pool")  # fmt: skip  # each microbenchmarks its forward and backward classes


def measure_classes(repeats: int) -> dict[str, list[tuple[float, float, float]]]:
    """(FLOPs, bytes, seconds) of the microbenchmark calls of every class of Note [Operator classes]."""
    out: dict[str, list[tuple[float, float, float]]] = {}
    for family in FAMILIES:
        calls = conv_calls() if family == "conv" else [c for mib in POINTWISE_MIB for c in pointwise_calls(family, mib)]
        for (func, _), timed in zip(calls, time_calls(calls, repeats)):
            out.setdefault(CLASS_OF[packet(str(func))], []).append(timed)
    for cls, timed in out.items():
        flop_rate, byte_rate = fit_rates(timed)
        log(f"  {cls}: " + (f"{flop_rate / 1e9:.1f} GFLOP/s + " if flop_rate else "") + f"{byte_rate / 1e9:.1f} GB/s")
    return out


def measure_attention(repeats: int) -> dict[int, tuple[float, float]]:
    """(FLOPs, seconds) of CPU flash attention forward and backward by head dim (4M scores per call)."""
    out = {}
    for d in HEAD_DIMS:
        calls = []
        for tokens in ATTENTION_TOKENS:
            q, k, v = (torch.randn(1, (1 << 22) // tokens**2, tokens, d) for _ in range(3))
            o, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)
            calls += [(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v)),
                      (aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                       (torch.randn_like(o), q, k, v, o, lse, 0.0, False))]  # fmt: skip
        timed = time_calls(calls, repeats)
        out[d] = (sum(flops for flops, _, _ in timed), sum(seconds for _, _, seconds in timed))
        log(f"  attention, head dim {d}: {out[d][0] / out[d][1] / 1e9:.1f} GFLOP/s")
    return out


def measure_fresh_pages(repeats: int) -> tuple[int, float, float]:
    """(output bytes, seconds out of place, seconds into a warm buffer) of a multiply whose output is twice
    ``FRESH_PAGES_MIN`` (Note [Operator classes])."""
    n = FRESH_PAGES_MIN * 2 // 4
    x, y, z = torch.randn(n), torch.randn(n), torch.empty(n)
    fresh = median_seconds(lambda: torch.mul(x, y), repeats)
    warm = median_seconds(lambda: torch.mul(x, y, out=z), repeats)
    log(f"mul with a {4 * n // MiB} MiB output: {12 * n / fresh / 1e9:.1f} GB/s out of place, "
        f"{12 * n / warm / 1e9:.1f} GB/s into a warm buffer")  # fmt: skip
    return 4 * n, fresh, warm


def tiny_model() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(TINY_LAYERS):
        layers += [nn.Linear(TINY_WIDTH, TINY_WIDTH), nn.GELU(), nn.LayerNorm(TINY_WIDTH)]
    return nn.Sequential(*layers)


def tiny_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, TINY_WIDTH), torch.randn(n, TINY_WIDTH)


def tiny_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def training_step(model_fn: Callable[[], nn.Module], batch_fn: Callable[[int], Any], batch: int) -> Callable[[], None]:
    """One training step (``tiny_loss``, ``optimizer``) of a fresh, seeded model on one fixed batch."""
    torch.manual_seed(0)
    model, data = model_fn(), batch_fn(batch)
    opt = optimizer(model.parameters())

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        tiny_loss(model, data).backward()
        opt.step()

    return step


def tiny_steps(managed: bool, steps: int) -> float:
    """Median seconds of a tiny training step (after the manager's profiling iterations, when managed)."""
    step = training_step(tiny_model, tiny_batch, TINY_BATCH)
    if not managed:
        return median_seconds(step, steps, warmup=3)
    with swap.SwapManager(budget="1GiB", device="cpu", min_bytes="64KiB"):
        return median_seconds(step, steps, warmup=3)


def step_trace(model_fn: Callable[[], nn.Module], batch_fn: Callable[[int], Any], batch: int) -> Any:
    """The capture of a training step on ``tiny_loss`` and ``optimizer``."""
    return capture(model_fn, batch_fn, batch, tiny_loss, optimizer=optimizer, target="cpu")


def operators(trace: Any) -> int:
    """Operators the capture records in the trace's last training step."""
    begin, end = trace.iterations()[-1]
    return int((trace.op[begin : end + 1] == swap.capture.trace.OP).sum())


def schedule_copies(schedule: Any) -> int:
    """Copies a schedule issues per step: each swap-out and each swap-in (Note [The runtime's cost per copy])."""
    return sum(map(len, schedule.swap_out)) + sum(map(len, schedule.swap_in))


def save_mlp(width: int, depth: int) -> nn.Module:
    """An MLP of Note [The runtime's cost per copy]: every Linear's input and GELU's input saved."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def save_batch(width: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, width), torch.randn(n, width)


def swap_step(width: int, depth: int, repeats: int) -> tuple[int, int, int, float, float]:
    """(operators, copies and bytes copied per planned step, seconds of a plain step, of a planned one) of the
    MLP ``width`` wide and ``depth`` layers deep (Note [The runtime's cost per copy])."""
    model_fn, batch_fn = functools.partial(save_mlp, width, depth), functools.partial(save_batch, width)
    ops = operators(step_trace(model_fn, batch_fn, SAVE_BATCH))
    step = training_step(model_fn, batch_fn, SAVE_BATCH)
    plain = median_seconds(step, repeats, warmup=3)
    manager = functools.partial(swap.SwapManager, device="cpu", min_bytes=SAVE_MIN_BYTES, policy="window")
    with manager(budget="1GiB") as sm:  # profiles the step (then declines): the budgets it could run at
        for _ in range(3):
            step()
        r = sm.report()
    least, peak = r["min_budget_bytes"], r["no_swap_peak_bytes"]
    with manager(budget=least + (peak - least) // 5) as sm:
        for _ in range(3):  # two profiling iterations, then planned
            step()
        before = sm.report()
        swapped = median_seconds(step, repeats, warmup=0)
        after, schedule = sm.report(), sm.schedule
    if after["declined"] or schedule is None or after["replans"] != before["replans"]:
        raise RuntimeError(f"the {width}-wide MLP's step did not run one plan under the manager: {after}")
    moved = sum(after[k] - before[k] for k in ("swapped_out_bytes", "swapped_in_bytes")) // repeats
    return ops, schedule_copies(schedule), moved, plain, swapped


def measure(repeats: int = 30) -> CpuMeasurements:
    """Times the kernels and the tiny step on this machine (a few tens of seconds)."""
    a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)
    mm = median_seconds(lambda: torch.mm(a, b), repeats)
    log(f"matmul {MATMUL_N}^3: {mm * 1e3:.2f} ms = {2 * MATMUL_N**3 / mm / 1e9:.1f} GFLOP/s")
    n = TENSOR_BYTES // 4
    operands = itertools.cycle([(torch.randn(n), torch.randn(n)) for _ in range(COLD_BYTES // TENSOR_BYTES // 2)])
    mul = median_seconds(lambda: torch.mul(*next(operands)), repeats * 3)

    def copy_next() -> None:
        src, dst = next(operands)
        dst.copy_(src)

    copy = median_seconds(copy_next, repeats * 3)
    log(f"mul of {TENSOR_BYTES // MiB} MiB tensors: {3 * TENSOR_BYTES / mul / 1e9:.1f} GB/s; "
        f"copy_: {TENSOR_BYTES / copy / 1e9:.1f} GB/s")  # fmt: skip
    big, fresh, warm = measure_fresh_pages(repeats)
    log("operator classes (Note [Operator classes]):")
    classes, attention = measure_classes(max(5, repeats // 3)), measure_attention(max(3, repeats // 6))
    trace = step_trace(tiny_model, tiny_batch, TINY_BATCH)
    ops = operators(trace)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    partial = CpuMeasurements(MATMUL_N, mm, TENSOR_BYTES, mul, TENSOR_BYTES, copy, ops, 0.0, 0.0, 0.0,
                              torch.get_num_threads(), memory, classes, attention, big, fresh, warm)  # fmt: skip
    unit = dataclasses.replace(profile_from(dataclasses.replace(partial, tiny_ops=1)).device, op_overhead=0.0)
    roofline = iteration_seconds(trace, unit)
    plain, managed = [], []
    for _ in range(3):  # interleaved: the machine is shared, so its speed drifts
        gc.collect()
        plain.append(tiny_steps(False, repeats * 2))
        gc.collect()
        managed.append(tiny_steps(True, repeats * 2))
    step, step_managed = statistics.median(plain), statistics.median(managed)
    log(f"tiny step: {ops} operators, {step * 1e3:.2f} ms plain, {step_managed * 1e3:.2f} ms under SwapManager "
        f"(roofline {roofline * 1e6:.0f} us)")  # fmt: skip
    swaps = []
    for width, depth in SAVE_MLPS:
        gc.collect()
        swaps.append(swap_step(width, depth, repeats))
        ops_w, copies, moved, plain_w, swapped_w = swaps[-1]
        log(f"{width}-wide {depth}-layer MLP: {ops_w} operators, plain {plain_w * 1e3:.2f} ms, planned "
            f"{swapped_w * 1e3:.2f} ms ({copies} copies, {moved / MiB:.1f} MiB)")  # fmt: skip
    return dataclasses.replace(partial, tiny_roofline_seconds=roofline, tiny_step_seconds=step,
                               tiny_managed_step_seconds=step_managed, swap_steps=swaps)  # fmt: skip


def median_of(rounds: list[CpuMeasurements]) -> CpuMeasurements:
    """The median of each measured time over calibration rounds (the work measured is the same in each); pure."""
    first = rounds[0]
    med = statistics.median
    times = {f: med(getattr(r, f) for r in rounds) for f in
             ("matmul_seconds", "mul_seconds", "copy_seconds", "tiny_roofline_seconds", "tiny_step_seconds",
              "tiny_managed_step_seconds", "fresh_seconds", "warm_seconds")}  # fmt: skip
    classes = {cls: [(f, b, med(r.classes[cls][k][2] for r in rounds)) for k, (f, b, _) in enumerate(calls)]
               for cls, calls in first.classes.items()}  # fmt: skip
    attention = {d: (f, med(r.attention[d][1] for r in rounds)) for d, (f, _) in first.attention.items()}
    swaps = [(*counts, med(r.swap_steps[k][3] for r in rounds), med(r.swap_steps[k][4] for r in rounds))
             for k, (*counts, _, _) in enumerate(first.swap_steps)]  # fmt: skip
    return dataclasses.replace(first, **times, classes=classes, attention=attention, swap_steps=swaps)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", default=str(PATH))
    ap.add_argument("--rounds", type=int, default=3, help="calibration rounds; each time is their median")
    args = ap.parse_args(argv)
    torch.set_num_threads(THREADS)
    rounds = []
    for k in range(args.rounds):
        log(f"round {k + 1}/{args.rounds}")
        rounds.append(measure())
    m = median_of(rounds)
    p = profile_from(m, platform.processor() or platform.machine())
    convs = m.classes["conv"] + m.classes["conv_backward"]
    one = fit_errors(convs, (sum(c[0] for c in convs) / sum(c[2] for c in convs), 0.0))
    two = np.concatenate([fit_errors(m.classes[c], p.device.class_rates[c]) for c in ("conv", "conv_backward")])
    log(f"convolutions, per call: one FLOP/s misses by {one.min():+.0%} to {one.max():+.0%}; FLOP/s + bytes/s by "
        f"{two.min():+.0%} to {two.max():+.0%}, {np.mean(abs(two) <= 0.25):.0%} of calls within 25%")  # fmt: skip
    d = p.device
    log(f"profile: {d.fp32_flops / 1e9:.1f} GFLOP/s, {d.mem_bandwidth / 1e9:.1f} GB/s, {d.op_overhead * 1e6:.1f} us "
        f"per operator (+{p.runtime_op_overhead * 1e6:.1f} us under SwapManager), "
        f"link {p.link_bandwidth / 1e9:.1f} GB/s")
    copies, nbytes, seconds = copy_costs(m, p.runtime_op_overhead)
    fitted = copies * p.runtime_save_overhead + nbytes / p.copy_bandwidth
    log(f"planned steps: +{p.runtime_save_overhead * 1e6:.1f} us per copy, copies at {p.copy_bandwidth / 1e9:.2f} "
        "GB/s; fit per MLP (predicted / measured ms): " + ", ".join(
            f"{w}x{d} {f * 1e3:.2f} / {s * 1e3:.2f}" for (w, d), f, s in zip(SAVE_MLPS, fitted, seconds)))  # fmt: skip
    doc = {"command": "python -m bench.cpu_profile", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
           "machine": platform.machine(), "rounds": args.rounds, "measurements": dataclasses.asdict(m),
           "profile": p.to_json()}  # fmt: skip
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
