"""Small models for the tiling tests (every FT-compatible operator kind, and the ones that end a segment), and
the tolerance they are compared with."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Mixed2d(nn.Module):
    """Convolutions (padded, strided, dilated, grouped, 'same'), max and average pooling (ceil mode, padding),
    eval-mode BatchNorm, in-place and functional pointwise ops, arithmetic with a number; then a head that
    ends the segment (global pooling, flatten, linear)."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, c, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=2, dilation=2, groups=2)
        self.bn = nn.BatchNorm2d(c)
        self.pool1 = nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True)
        self.conv3 = nn.Conv2d(c, 2 * c, 5, stride=2, padding=2)
        self.pool2 = nn.AvgPool2d(2)
        self.conv4 = nn.Conv2d(2 * c, 2 * c, 3, padding="same")
        self.fc = nn.Linear(2 * c, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.conv1(x))
        x = F.silu(self.bn(self.conv2(x)))
        x = self.conv3(self.pool1(x)) * 0.5
        x = F.max_pool2d(torch.tanh(self.pool2(x)), 2, ceil_mode=True)
        x = self.conv4(x).relu()
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


# Note [Tiled gradient tolerance] (test_tiled_spatial.py); bfloat16: Note [bf16 head tolerance] (test_tiled_head.py)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2**-5}


def assert_close(tiled: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """``tiled`` within TOLERANCE of ``ref``, relative to ``ref``'s largest element."""
    scale = ref.abs().max().item() or 1.0
    err = (tiled - ref).abs().max().item()
    assert err <= TOLERANCE[ref.dtype] * scale, f"{what}: error {err:.3g} over {TOLERANCE[ref.dtype]} x {scale:.3g}"


def chain1d(c: int = 4) -> nn.Sequential:
    return nn.Sequential(nn.Conv1d(2, c, 5, padding=2), nn.GELU(), nn.MaxPool1d(2), nn.Conv1d(c, c, 3, stride=2),
                         nn.ReLU(), nn.AvgPool1d(3, stride=1, padding=1))  # fmt: skip


def chain3d(c: int = 2) -> nn.Sequential:
    return nn.Sequential(nn.Conv3d(1, c, 3, padding=1), nn.ReLU(), nn.MaxPool3d(2), nn.Conv3d(c, c, 3, padding=1),
                         nn.Sigmoid())  # fmt: skip


def vgg(c: int = 4, blocks: tuple[int, ...] = (2, 2, 3)) -> nn.Sequential:
    """A VGG-style network: blocks of 3x3 convolutions and ReLU, each closed by 2x2 max pooling."""
    layers: list[nn.Module] = []
    cin = 3
    for k, n in enumerate(blocks):
        cout = c * 2**k
        for _ in range(n):
            layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(inplace=True)]
            cin = cout
        layers.append(nn.MaxPool2d(2))
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers)


class Residual(nn.Module):
    """A residual add (joins two activations) and a training-mode BatchNorm and Dropout: each ends a segment."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, c, 3, padding=1)
        self.b = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.drop = nn.Dropout(0.5)
        self.c = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.a(x))
        y = y + self.b(y)
        return self.c(self.drop(self.bn(y)))
