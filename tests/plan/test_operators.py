"""Operator events in captured traces (Note [Trace file format]) and their pricing (Note [Per-operator
roofline]): each operator's own cost, module, phase and precision; allocations after their operator; scaling,
files, older traces; the roofline per operator against per segment."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_models import TinyCNN, cnn_batch
from torch import nn

from swap.capture import ALLOC, FREE, ITER_BEGIN, ITER_END, OP, PHASE, SAVE, USE, LinearTrace, Trace, capture
from swap.capture.trace import LOW_PRECISION
from swap.devices import DeviceProfile
from swap.forecast.from_trace import sequence_from_trace
from swap.forecast.pricing import event_seconds, iteration_seconds

# A device with round numbers: 1 TFLOP/s on fp32, 4 on bf16, 100 GB/s, full efficiency.
DEV = DeviceProfile("test", 1e12, 4e12, 100e9, 10e9, 10e9, 1 << 30, efficiency=1.0)


@pytest.fixture(scope="module")
def cnn():
    return capture(TinyCNN, cnn_batch, 4)


def last(t: Trace) -> slice:
    b, e = t.iterations()[-1]
    return slice(b, e + 1)


def ops_of(t: Trace, phase: str, module: str | None = "any") -> list[str]:
    """The operator names of the last iteration in ``phase`` (and ``module``, unless "any")."""
    out = []
    for k in range(*last(t).indices(len(t))):
        if t.op[k] == OP and t.phase[k] == PHASE[phase] and (module == "any" or t.module_name(k) == module):
            out.append(t.op_name(k))
    return out


def test_every_operator_carries_its_own_cost_and_the_accesses_none(cnn):
    t = cnn
    ops = t.op == OP
    assert ops.sum() > 0 and set(t.meta["ops"]) >= {"aten.convolution.default", "aten.mm.default"}
    # The costs live on the operators; saves, uses and iteration ends carry none (format 6).
    assert t.flops[~ops].sum() == 0 and t.bytes[~ops].sum() == 0
    assert not [n for n in t.meta["ops"] if n.startswith("profiler.")]  # markers are not operators
    assert (t.bytes[ops] > 0).mean() > 0.95  # they move data (views are left out; a few outputs are empty)
    # A 3x3 convolution of 3 -> 8 channels on 4 x 16 x 16 pixels: 2 * 4 * 8 * 16 * 16 * 3 * 9 FLOPs.
    conv = [k for k in np.flatnonzero(ops) if t.op_name(k) == "aten.convolution.default"]
    assert t.flops[conv[0]] == 2 * 4 * 8 * 16 * 16 * 3 * 9
    # The other arrays say nothing about non-operator events.
    assert (t.module[~ops] == -1).all() and (t.phase[~ops] == -1).all() and (t.precision[~ops] == -1).all()


def test_allocations_follow_the_operator_that_made_them(cnn):
    t = cnn
    producer = {}  # allocation id -> the operator event right before its alloc
    current = None
    for k in range(len(t)):
        if t.op[k] == OP:
            current = k
        elif t.op[k] == ALLOC:
            if current is not None:
                producer[int(t.id[k])] = current
        elif t.op[k] != FREE:  # frees may come at any time (a storage dies); nothing else sits in between
            current = None
    before = t.iterations()[0][0]
    allocs = [k for k in range(before, len(t)) if t.op[k] == ALLOC]
    assert all(int(t.id[k]) in producer for k in allocs)  # within iterations, every allocation has its operator
    saved = {t.op_name(producer[int(t.id[k])]) for k in range(len(t)) if t.op[k] == SAVE}
    # TinyCNN saves the convolutions' and batch norms' outputs, the ReLUs' (in their threshold_backward), ...
    assert {"aten.convolution.default", "aten.relu.default"} <= saved


def test_phases_and_modules_forward_and_backward(cnn):
    t = cnn
    assert ops_of(t, "forward", "body.0") == ["aten.convolution.default"]
    # The backward of a module's operators is attributed to the module whose forward made the node.
    assert "aten.convolution_backward.default" in ops_of(t, "backward", "body.0")
    assert "aten.mm.default" in ops_of(t, "backward", "head")
    assert ops_of(t, "batch") and ops_of(t, "optimizer") and not ops_of(t, "recompute")
    assert all(m is None for m in (t.module_name(k) for k in range(len(t)) if t.phase[k] == PHASE["optimizer"]))


class UpcastLoss(nn.Module):
    """A bf16 model whose loss runs in fp32, as language models upcast their logits."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def upcast_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def vectors(n: int) -> tuple:
    return torch.randn(n, 16), torch.randint(0, 8, (n,))


def test_precision_per_operator():
    t = capture(UpcastLoss, vectors, 4, upcast_loss, dtype=torch.bfloat16)
    lowp = {t.op_name(k) for k in np.flatnonzero(t.op == OP) if t.precision[k] == LOW_PRECISION}
    fp32 = {t.op_name(k) for k in np.flatnonzero(t.op == OP) if t.precision[k] == 0}
    assert "aten.addmm.default" in lowp and "aten._log_softmax.default" in fp32
    # Priced per operator, the fp32 loss runs on the fp32 peak although the model is bf16.
    k = next(k for k in np.flatnonzero(t.op == OP) if t.op_name(k) == "aten._log_softmax.default")
    compute_bound = dataclasses.replace(DEV, mem_bandwidth=1e30)
    assert event_seconds(t, compute_bound)[k] == pytest.approx(t.flops[k] / 1e12)


def test_linear_scaling_and_files_keep_the_operators(tmp_path):
    lt = LinearTrace.fit(capture(TinyCNN, cnn_batch, 2), capture(TinyCNN, cnn_batch, 4))
    real = capture(TinyCNN, cnn_batch, 9)
    assert lt.check(real) is None
    scaled = lt.at(9)
    for name in ("module", "phase", "precision"):
        assert np.array_equal(getattr(scaled, name), getattr(real, name))
    assert np.allclose(scaled.flops, real.flops) and np.allclose(scaled.bytes, real.bytes)
    assert iteration_seconds(scaled, DEV) == pytest.approx(iteration_seconds(real, DEV))
    back = Trace.load(real.save(tmp_path / "t.npz"))
    for name in ("op", "flops", "bytes", "module", "phase", "precision"):
        assert np.array_equal(getattr(back, name), getattr(real, name))
    assert back.meta["ops"] == real.meta["ops"] and back.meta["modules"] == real.meta["modules"]


def segment_trace(low_precision: bool = False) -> Trace:
    """A format-5 style trace: one activation saved and used, each step's cost summed on its access."""
    op = np.array([ITER_BEGIN, ALLOC, SAVE, USE, FREE, ITER_END], dtype=np.uint8)
    ids = np.array([0, 1, 1, 1, 1, 0])
    size = np.array([0, 1 << 20, 1 << 20, 1 << 20, 1 << 20, 0])
    flops = np.array([0, 0, 2e9, 1e9, 0, 0], dtype=float)
    moved = np.array([0, 0, 1e8, 4e8, 0, 0], dtype=float)
    z = np.zeros(len(op), dtype=np.uint8)
    meta = {"format_version": 5, "dtype": "bfloat16" if low_precision else "float32"}
    return Trace(op, ids, size, z, z.astype(np.int64), flops, moved, meta)


def operator_trace() -> Trace:
    """The same two steps with their operators recorded: the save's step is a compute-bound matmul (2 GFLOP,
    20 MB) and a memory-bound copy (80 MB); the use's, a memory-bound op (1 GFLOP, 400 MB)."""
    op = np.array([ITER_BEGIN, OP, ALLOC, OP, SAVE, OP, USE, FREE, ITER_END], dtype=np.uint8)
    ids = np.array([0, 0, 1, 1, 1, 2, 1, 1, 0])
    size = np.array([0, 0, 1 << 20, 0, 1 << 20, 0, 1 << 20, 1 << 20, 0])
    flops = np.array([0, 2e9, 0, 0, 0, 1e9, 0, 0, 0], dtype=float)
    moved = np.array([0, 2e7, 0, 8e7, 0, 4e8, 0, 0, 0], dtype=float)
    is_op = op == OP
    z = np.zeros(len(op), dtype=np.uint8)
    names = ["aten.mm.default", "aten.copy_.default", "aten.mul.Tensor"]
    meta = {"format_version": 6, "dtype": "float32", "ops": names, "modules": []}
    phase = np.where(is_op, PHASE["forward"], -1).astype(np.int8)
    fp32 = np.where(is_op, 0, -1).astype(np.int8)
    return Trace(op, ids, size, z, z.astype(np.int64), flops, moved, meta, np.full(len(op), -1, np.int32), phase, fp32)


def test_the_roofline_per_operator_against_per_segment():
    per_op, per_segment = operator_trace(), segment_trace()
    # Per segment, the matmul's 2 ms of compute hides the copy's 0.8 ms of memory traffic: max(2, 1) ms.
    assert sequence_from_trace(per_segment, cost=DEV).compute == pytest.approx([2e-3 + 4e-3, 0])
    # Per operator, neither hides the other: 2 ms + 0.8 ms in the save's step, then the memory-bound 4 ms.
    seq = sequence_from_trace(per_op, cost=DEV)
    assert seq.compute == pytest.approx([2e-3 + 0.8e-3 + 4e-3, 0])
    assert event_seconds(per_op, DEV)[[1, 3, 5]] == pytest.approx([2e-3, 0.8e-3, 4e-3])
    assert iteration_seconds(per_op, DEV) == pytest.approx(sum(seq.compute))
    # Seconds per event can be given directly; a per-operator overhead is charged once per operator.
    assert sequence_from_trace(per_op, cost=event_seconds(per_op, DEV) * 2).compute == pytest.approx([13.6e-3, 0])
    slow = dataclasses.replace(DEV, op_overhead=1e-3)
    assert iteration_seconds(per_op, slow) == pytest.approx(iteration_seconds(per_op, DEV) + 3e-3)
    # An older trace of a bf16 model is priced on the bf16 peak (its sums carry no precision of their own):
    # the save's step becomes memory-bound.
    assert iteration_seconds(segment_trace(low_precision=True), DEV) == pytest.approx(1e-3 + 4e-3)


def test_format_5_files_still_load_and_unknown_ones_say_what_to_do(tmp_path):
    old = segment_trace()
    path = tmp_path / "old.npz"
    np.savez_compressed(path, op=old.op, id=old.id, size=old.size, tag=old.tag, stream=old.stream, flops=old.flops,
                        bytes=old.bytes, meta=np.array('{"format_version": 5, "dtype": "float32"}'))  # fmt: skip
    back = Trace.load(path)
    assert not back.has_ops() and (back.module == -1).all()
    assert sum(sequence_from_trace(back, cost=DEV).compute) == pytest.approx(6e-3)
    np.savez_compressed(path, op=old.op, meta=np.array('{"format_version": 4}'))
    with pytest.raises(ValueError, match="capture it again"):
        Trace.load(path)


class Attention(nn.Module):
    """One self-attention layer through SDPA (4 heads of 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, 4, 8).transpose(1, 2) for z in self.qkv(x).split(32, dim=2))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_batch(n: int) -> tuple:
    return torch.randn(n, 16, 32), torch.randn(n, 4, 16, 8)


def test_the_cpu_attention_kernels_carry_their_flops():
    # Note [FLOPs of the CPU attention kernels]: PyTorch's counter knows the CUDA kernels only; on CPU
    # attention cost nothing but its bytes.
    def loss(model: nn.Module, batch: tuple) -> torch.Tensor:
        return F.mse_loss(model(batch[0]), batch[1])

    flops = {}
    for target in ("cpu", "cuda"):
        t = capture(Attention, attention_batch, 2, loss, target=target)
        for k in range(*last(t).indices(len(t))):
            if t.op[k] == OP and "attention" in t.op_name(k):
                flops[(target, t.phase[k] == PHASE["backward"])] = t.flops[k]
    # Forward: QK^T and PV, 2 * 2 * b * h * t * t * d; backward: 2.5x that (PyTorch's formula).
    forward = 2 * 2 * 2 * 4 * 16 * 16 * 8
    assert flops[("cpu", False)] == flops[("cuda", False)] == forward
    assert flops[("cpu", True)] == flops[("cuda", True)] == 2.5 * forward
