"""The forecast prices fp32 convolutions and matmuls as PyTorch runs them (Note [Peaks by precision and kind] in
swap/devices.py): convolutions on TF32 tensor cores by default (cuDNN's), matmuls when PyTorch's flag or
``tf32=`` says so. Measured on an H200 with both on, ResNet-50 trained at 2062 images/s where the forecast on the
fp32 peak said 1535 (bench/results/gpu/NVIDIA_H200/training.md)."""

import pytest
import torch
from tiny_models import TinyCNN, cnn_batch
from torch import nn

import swap
from swap.capture import OP, capture
from swap.cli import main
from swap.devices import profile, with_tf32
from swap.forecast.pricing import event_seconds

H200 = profile("h200")


class ConvAndLinear(nn.Module):
    """One convolution and one matmul big enough that both are compute-bound on an H200."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(256, 256, 3, padding=1, bias=False)
        self.fc = nn.Linear(256 * 8 * 8, 4096, bias=False)

    def forward(self, x):
        return self.fc(self.conv(x).flatten(1))


def images(n):
    return torch.randn(n, 256, 8, 8), torch.randint(0, 4096, (n,))


def forward_seconds(dev, dtype=None):
    """Seconds of the forward convolution and the forward matmul of the last step, and their FLOPs."""
    t = capture(ConvAndLinear, images, 512, dtype=dtype)
    b, e = t.iterations()[-1]
    seconds = event_seconds(t, dev)
    names = t.meta["ops"]
    out = {}
    for k in range(b, e):
        name = names[t.id[k]] if t.op[k] == OP else ""
        if name in ("aten.convolution.default", "aten.mm.default") and name not in out:
            out[name] = (seconds[k], t.flops[k])
    return out["aten.convolution.default"], out["aten.mm.default"]


def at(peak, dev=H200):
    return lambda flops: flops / (peak * dev.efficiency)


@pytest.mark.parametrize(
    "setting, conv_peak, mm_peak",
    [("off", 67e12, 67e12), ("on", 495e12, 495e12), (False, 67e12, 67e12), (True, 495e12, 495e12)],
)
def test_fp32_operators_on_the_peak_the_setting_gives(setting, conv_peak, mm_peak):
    (conv, conv_flops), (mm, mm_flops) = forward_seconds(with_tf32(H200, setting))
    assert conv == pytest.approx(at(conv_peak)(conv_flops))
    assert mm == pytest.approx(at(mm_peak)(mm_flops))


def test_auto_follows_pytorchs_flags(torch_flags):
    # PyTorch's defaults: cuDNN convolutions in TF32, cuBLAS matmuls in fp32.
    torch_flags(torch.backends.cudnn, "allow_tf32", True)
    torch_flags(torch.backends.cuda.matmul, "allow_tf32", False)
    (conv, conv_flops), (mm, mm_flops) = forward_seconds(with_tf32(H200, "auto"))
    assert conv == pytest.approx(at(495e12)(conv_flops)) and mm == pytest.approx(at(67e12)(mm_flops))
    assert forward_seconds(H200) == forward_seconds(with_tf32(H200, "auto"))  # the profile's default is PyTorch's
    torch_flags(torch.backends.cuda.matmul, "allow_tf32", True)  # set_float32_matmul_precision("high")
    (_, _), (mm, mm_flops) = forward_seconds(with_tf32(H200, "auto"))
    assert mm == pytest.approx(at(495e12)(mm_flops))


@pytest.fixture
def precision_api():
    """PyTorch's fp32_precision settings, put back afterwards (while they disagree with the legacy flags,
    PyTorch refuses to read those)."""
    cublas, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = cublas.fp32_precision, conv.fp32_precision
    yield cublas, conv
    cublas.fp32_precision, conv.fp32_precision = before


def test_auto_follows_pytorchs_fp32_precision_settings(precision_api):
    cublas, conv = precision_api
    cublas.fp32_precision, conv.fp32_precision = "tf32", "ieee"  # the settings that replace allow_tf32
    dev = with_tf32(H200, "auto")
    assert dev.tf32_matmul and not dev.tf32_conv


def test_bf16_stays_on_the_tensor_core_peak_and_profiles_without_tf32_on_fp32():
    (conv, conv_flops), (mm, mm_flops) = forward_seconds(with_tf32(H200, "on"), torch.bfloat16)
    assert conv == pytest.approx(at(989e12)(conv_flops)) and mm == pytest.approx(at(989e12)(mm_flops))
    v100 = with_tf32(profile("v100"), "on")  # no TF32 tensor cores
    (conv, conv_flops), _ = forward_seconds(v100)
    assert conv == pytest.approx(at(15.7e12, v100)(conv_flops))


def test_a_bad_setting_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="auto, on, off"):
        with_tf32(H200, "yes")


def test_the_plan_and_the_command_line_take_tf32(capsys):
    def fast(tf32):
        return swap.plan(TinyCNN, cnn_batch, budget="64MiB", device="h200", max_batch=8, strategies=(),
                         policies=("none",), progress=False, tf32=tf32, optimizer=None)  # fmt: skip

    on, off = fast("on"), fast("off")
    assert on.throughput["none"] > off.throughput["none"]
    assert "convolutions priced in TF32" in " ".join(on.notes) and "in fp32" in " ".join(off.notes)
    with pytest.raises(SystemExit):
        main(["--model", "resnet50", "--budget", "16GiB", "--tf32", "maybe"])
    assert "--tf32: invalid choice" in capsys.readouterr().err
