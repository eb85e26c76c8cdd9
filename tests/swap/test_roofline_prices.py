"""The operator profiler prices CUDA operators on the device profile's roofline, by precision and kind: bf16 on
tensor cores, fp32 convolutions on TF32 tensor cores (cuDNN's default), fp32 matmuls on the fp32 peak unless
PyTorch's flag lets them use TF32 (Note [Peaks by precision and kind] in swap/devices.py). Checked on an H100's
rates, with meta tensors standing in for the device's (the profiler prices shapes; nothing runs)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from swap.devices import cuda_profile, profile
from swap.runtime.auto.op_profiler import OpProfiler

H100 = profile("h100-sxm")


def prices(monkeypatch, torch_flags, matmul_tf32=False):
    """Seconds the profiler gives each operator of a forward, on a CUDA device that torch names an H100."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    torch_flags(torch.backends.cuda.matmul, "allow_tf32", matmul_tf32)  # Note [Backend flags are not attributes]
    timer = SimpleNamespace(exclude=lambda seconds: None)  # the profiler's own time, taken off the step's
    executor = SimpleNamespace(in_backward=False, step=0, backward_done=False, timer=timer)
    hooks = SimpleNamespace(busy=False, pair=None, manages=lambda t: False)
    profiler = OpProfiler(executor, hooks, torch.device("cuda"))
    m = 2048

    def meta(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    a, b = meta(m, m), meta(m, m, dtype=torch.bfloat16)
    x, w, big = meta(32, 256, 28, 28), meta(256, 256, 3, 3), meta(64, m, m)
    tokens, experts = meta(8192, 4096, dtype=torch.bfloat16), meta(4, 4096, 4096, dtype=torch.bfloat16)
    offsets = torch.empty(4, dtype=torch.int32, device="meta")
    with profiler:
        torch.mm(a, a)
        torch.mm(b, b)
        F.conv2d(x, w, padding=1)
        torch.relu(big)
        torch._grouped_mm(tokens, experts, offs=offsets)  # mixture-of-experts' grouped matmul
    profiler.iteration_starts()
    return profiler.table.ops


def compute(dev, flops, peak):
    return flops / (peak * dev.efficiency)


def memory(dev, nbytes):
    return nbytes / (dev.mem_bandwidth * dev.efficiency)


def test_prices_by_precision_and_kind_on_the_h100s_rates(monkeypatch, torch_flags):
    mm32, mm16, conv, relu, grouped = prices(monkeypatch, torch_flags)
    flops = 2 * 2048**3
    assert mm32.flops == mm16.flops == flops
    # Only relative prices count (the profiler scales them to the measured forward): bf16 runs 989 / 67 times
    # as fast as fp32 through a matmul, a TF32 convolution 495 / 67 times per FLOP.
    assert mm32.seconds / mm16.seconds == pytest.approx(989 / 67)
    assert (conv.seconds / conv.flops) / (mm32.seconds / flops) == pytest.approx(67 / 495)
    assert mm32.seconds == pytest.approx(compute(H100, flops, 67e12))  # fp32 matmul: no TF32 by default
    assert mm16.seconds == pytest.approx(compute(H100, flops, 989e12))  # bf16: tensor cores
    assert conv.seconds == pytest.approx(compute(H100, conv.flops, 495e12))  # fp32 conv: TF32 (cuDNN's default)
    assert relu.seconds == pytest.approx(memory(H100, relu.nbytes))  # pointwise: its bytes
    assert grouped.flops == 2 * 8192 * 4096 * 4096  # each routed row through one expert's matrix
    assert grouped.seconds == pytest.approx(compute(H100, grouped.flops, 989e12))
    # An H100's compute-to-bandwidth ratios: about 295 FLOP/B in bf16, 148 in TF32, 20 in fp32.
    peaks = (H100.lowp_flops, H100.tf32_flops, H100.fp32_flops)
    assert [round(p / H100.mem_bandwidth) for p in peaks] == [295, 148, 20]


def test_fp32_matmuls_take_tf32_when_pytorch_allows_it(monkeypatch, torch_flags):
    mm32, _, conv, _, _ = prices(monkeypatch, torch_flags, matmul_tf32=True)
    assert mm32.seconds == pytest.approx(compute(H100, mm32.flops, 495e12))
    assert conv.seconds == pytest.approx(compute(H100, conv.flops, 495e12))


@pytest.mark.parametrize(
    "name, key",
    [("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H200", "h200"),
     ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100 80GB PCIe", "a100-80gb"), ("NVIDIA L4", "l4"),
     ("NVIDIA GeForce RTX 4090", "rtx4090-24gb"), ("Tesla V100-SXM2-16GB", "v100-16gb"), ("Some GPU", "h100-sxm")],
)  # fmt: skip
def test_the_profile_of_a_cuda_device_by_its_name(name, key):
    assert cuda_profile(name) is profile(key)
