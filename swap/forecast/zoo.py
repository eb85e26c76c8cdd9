"""The built-in models ``python -m swap.plan --model NAME`` plans, the benchmarks capture and the tests train.

Defined in the project (torchvision's compiled ops do not load with the CPU torch build):

- ``resnet(layers, width)``: bottleneck ResNet; ``resnet50()`` is the paper's ResNet-50 (25.6 M params).
- ``densenet(blocks, growth)``: DenseNet-BC; ``densenet121()``.
- ``unet(depth, width)``: 2-D U-Net, long skip connections by concatenation.
- ``gpt(n_layer, n_head, d_model, vocab, seq_len)``: GPT-2-style decoder, causal attention through
  ``F.scaled_dot_product_attention``; ``gpt2()`` is GPT-2 small, ``gpt2_medium()`` GPT-2 medium.
- ``llama(n_layer, d_model, n_head, n_kv_head, d_ff, vocab)``: a Llama-style decoder (RMSNorm, rotary
  positions, grouped-query attention, SwiGLU MLP, no biases, untied head); ``llama3_8b()`` and ``llama3_70b()``
  have the shapes of Llama-3-8B and Llama-3-70B (Note [Llama shapes]).

Each builder takes small sizes for CPU tests and full sizes for the benchmarks; ``example_batch(model, ...)``
returns matching inputs and targets. ``ZOO`` names the full-size workloads: how to build each, its batches
and its optimizer (SGD with momentum, as the window-scheduling paper trains), for ``swap.capture.capture`` and
``swap.plan`` (the Llama shapes: AdamW, as fine-tunes train them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


# -- ResNet -------------------------------------------------------------------------------------------------
class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In-place ReLU and residual add, as torchvision's ResNet: the memory profile users actually train.
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = F.relu(self.bn2(self.conv2(out)), inplace=True)
        out = self.bn3(self.conv3(out))
        out += x if self.down is None else self.down(x)
        return F.relu(out, inplace=True)


class ResNet(nn.Module):
    def __init__(self, layers: Sequence[int] = (3, 4, 6, 3), width: int = 64, num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, 2, 3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        blocks, cin = [], width
        for i, n in enumerate(layers):
            w = width * 2**i
            for j in range(n):
                blocks.append(Bottleneck(cin, w, 2 if (j == 0 and i > 0) else 1))
                cin = w * Bottleneck.expansion
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet(layers: Sequence[int] = (3, 4, 6, 3), width: int = 64, num_classes: int = 1000) -> ResNet:
    return ResNet(layers, width, num_classes)


def resnet50(num_classes: int = 1000) -> ResNet:
    return ResNet((3, 4, 6, 3), 64, num_classes)


# -- DenseNet -----------------------------------------------------------------------------------------------
class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int) -> None:
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(cin), nn.Conv2d(cin, 4 * growth, 1, bias=False)
        self.bn2, self.conv2 = nn.BatchNorm2d(4 * growth), nn.Conv2d(4 * growth, growth, 3, 1, 1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(features, 1)
        x = self.conv1(F.relu(self.bn1(x)))
        return self.conv2(F.relu(self.bn2(x)))


class DenseNet(nn.Module):
    def __init__(self, blocks: Sequence[int] = (6, 12, 24, 16), growth: int = 32, num_classes: int = 1000) -> None:
        super().__init__()
        c = 2 * growth
        self.stem = nn.Sequential(
            nn.Conv2d(3, c, 7, 2, 3, bias=False), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        self.stages = nn.ModuleList()
        self.transitions = nn.ModuleList()
        for i, n in enumerate(blocks):
            layers = nn.ModuleList()
            for _ in range(n):
                layers.append(DenseLayer(c, growth))
                c += growth
            self.stages.append(layers)
            if i < len(blocks) - 1:
                self.transitions.append(
                    nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c // 2, 1, bias=False), nn.AvgPool2d(2))
                )
                c //= 2
        self.norm = nn.BatchNorm2d(c)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for i, layers in enumerate(self.stages):
            features = [x]
            for layer in layers:
                features.append(layer(features))
            x = torch.cat(features, 1)
            if i < len(self.transitions):
                x = self.transitions[i](x)
        x = F.relu(self.norm(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def densenet(blocks: Sequence[int] = (6, 12, 24, 16), growth: int = 32, num_classes: int = 1000) -> DenseNet:
    return DenseNet(blocks, growth, num_classes)


def densenet121(num_classes: int = 1000) -> DenseNet:
    return DenseNet((6, 12, 24, 16), 32, num_classes)


# -- U-Net --------------------------------------------------------------------------------------------------
def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
    )  # fmt: skip


class UNet(nn.Module):
    """Encoder features are kept until the decoder concatenates them: the long skips a swap schedule must
    carry across the whole forward and backward pass."""

    def __init__(self, depth: int = 4, width: int = 64, cin: int = 3, classes: int = 2) -> None:
        super().__init__()
        self.down = nn.ModuleList()
        c, widths = cin, []
        for i in range(depth):
            self.down.append(_double_conv(c, width * 2**i))
            c = width * 2**i
            widths.append(c)
        self.bottom = _double_conv(c, c * 2)
        c *= 2
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        for w in reversed(widths):
            self.up.append(nn.ConvTranspose2d(c, w, 2, stride=2))
            self.dec.append(_double_conv(2 * w, w))
            c = w
        self.head = nn.Conv2d(c, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottom(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips)):
            x = dec(torch.cat([up(x), skip], 1))
        return self.head(x)


def unet(depth: int = 4, width: int = 64, cin: int = 3, classes: int = 2) -> UNet:
    return UNet(depth, width, cin, classes)


# -- GPT ----------------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        # As users write it: PyTorch picks the kernel (flash or memory-efficient attention on a GPU, which
        # save a log-sum-exp per row instead of the t x t attention weights; the capture does the same).
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, n_layer: int = 12, n_head: int = 12, d_model: int = 768, vocab: int = 50257,
                 seq_len: int = 1024) -> None:  # fmt: skip
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def gpt(n_layer: int = 12, n_head: int = 12, d_model: int = 768, vocab: int = 50257, seq_len: int = 1024) -> GPT:
    return GPT(n_layer, n_head, d_model, vocab, seq_len)


def gpt2(seq_len: int = 1024) -> GPT:
    return GPT(12, 12, 768, 50257, seq_len)


def gpt2_medium(seq_len: int = 1024) -> GPT:
    """GPT-2 medium's shape (24 layers, 16 heads, d_model 1024; 355 M parameters with the untied head)."""
    return GPT(24, 16, 1024, 50257, seq_len)


# -- Llama ----------------------------------------------------------------------------------------------------
# Note [Llama shapes]
# The shapes of Meta's published configurations (the ``config.json`` of meta-llama/Meta-Llama-3-8B and
# Meta-Llama-3-70B on the Hugging Face hub): 8B: 32 layers, d_model 4096, 32 heads, 8 key/value heads, MLP
# 14336, vocabulary 128256 (8.03 B parameters); 70B: 80 layers, d_model 8192, 64 heads, 8 key/value heads,
# MLP 28672, the same vocabulary (70.6 B). Llama-3.1 has the same shapes (only the rotary scaling differs,
# which moves no bytes and no FLOPs). The rotary tables are computed in each forward from positions, as the
# memory a trainer holds; nothing is loaded: these are shapes for planning, not weights.
LOSS_CHUNK = 1024  # tokens per chunk of the loss (Note [Llama shapes])


class LlamaBlock(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, d_ff: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(d, d_ff, bias=False), nn.Linear(d, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d, bias=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-b, a), dim=-1) * sin

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, n_layer: int = 32, d_model: int = 4096, n_head: int = 32, n_kv_head: int = 8,
                 d_ff: int = 14336, vocab: int = 128256, rope_theta: float = 500000.0) -> None:  # fmt: skip
        super().__init__()
        self.head_dim, self.rope_theta = d_model // n_head, rope_theta
        self.tok = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(LlamaBlock(d_model, n_head, n_kv_head, d_ff) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d_model, eps=1e-5)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor, labels: Optional[torch.Tensor] = None) -> Any:
        hidden = self.norm(self._blocks(idx))
        if labels is None:
            return self.head(hidden)
        h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        loss = sum(checkpoint(self._chunk_loss, hc, yc, use_reentrant=False)
                   for hc, yc in zip(h.split(LOSS_CHUNK), y.split(LOSS_CHUNK)))  # fmt: skip
        return {"loss": loss / y.numel()}

    def _chunk_loss(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(h).float(), y, reduction="sum")

    def _blocks(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx)
        half = torch.arange(0, self.head_dim, 2, device=idx.device, dtype=torch.float32) / self.head_dim
        angles = torch.outer(torch.arange(t, device=idx.device, dtype=torch.float32), self.rope_theta ** -half)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        return x


def llama(n_layer: int = 32, d_model: int = 4096, n_head: int = 32, n_kv_head: int = 8, d_ff: int = 14336,
          vocab: int = 128256) -> Llama:  # fmt: skip
    return Llama(n_layer, d_model, n_head, n_kv_head, d_ff, vocab)


def llama3_8b(n_layer: int = 32) -> Llama:
    """Llama-3-8B's shape (Note [Llama shapes]); ``n_layer`` fewer for a scaled capture."""
    return Llama(n_layer, 4096, 32, 8, 14336, 128256)


def llama3_70b(n_layer: int = 80) -> Llama:
    """Llama-3-70B's shape (Note [Llama shapes]); ``n_layer`` fewer for a scaled capture."""
    return Llama(n_layer, 8192, 64, 8, 28672, 128256)


class VGG(nn.Module):
    """VGG (Simonyan & Zisserman): 3x3 convolutions and ReLU in blocks closed by 2x2 max pooling, then an
    adaptive 7x7 pooling and three linear layers. The network SFT (segmented fused-tiled
    execution) trains on 20K x 20K images."""

    def __init__(self, config: Sequence[Any], num_classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for v in config:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(cin, int(v), 3, padding=1), nn.ReLU(inplace=True)]
                cin = int(v)
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(7)
        self.classifier = nn.Sequential(nn.Linear(cin * 49, 4096), nn.ReLU(inplace=True), nn.Dropout(),
                                        nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout())  # fmt: skip
        self.fc = nn.Linear(4096, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.classifier(torch.flatten(self.pool(self.features(x)), 1)))


VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def vgg16(num_classes: int = 1000) -> VGG:
    """VGG-16 (configuration D, 138 M parameters)."""
    return VGG(VGG16, num_classes)


# -- inputs -------------------------------------------------------------------------------------------------
def example_batch(model: nn.Module, batch: int, size: int = 224, generator: torch.Generator | None = None,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(input, target) for ``model``: images and labels, images and masks, or tokens and next tokens."""
    g = generator or torch.Generator().manual_seed(0)
    if isinstance(model, (GPT, Llama)):
        tokens = torch.randint(0, model.tok.num_embeddings, (batch, size + 1), generator=g)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    x = torch.randn(batch, 3, size, size, generator=g).to(device)
    if isinstance(model, UNet):
        return x, torch.randint(0, model.head.out_channels, (batch, size, size), generator=g).to(device)
    return x, torch.randint(0, model.fc.out_features, (batch,), generator=g).to(device)


def loss_fn(model: nn.Module, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if isinstance(model, (GPT, Llama)):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return F.cross_entropy(out, target)


# -- the named workloads ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """A built-in model at full size: ``model_fn()``, ``batch_fn(size)(n)``, and how it trains."""

    name: str
    build: Callable[[], nn.Module]
    size: int  # image side, or sequence length
    kind: str  # "classify", "segment", "language" or "causal_lm" (a dict: the model returns its loss)
    classes: int  # classes, or vocabulary
    dtype: Optional[torch.dtype] = None
    optim: str = "sgd"  # "sgd": with momentum, as the window-scheduling paper trains; "adamw": a fine-tune

    def model_fn(self) -> Callable[[], nn.Module]:
        return self.build

    def batch_fn(self, size: Optional[int] = None) -> Callable[[int], Any]:
        """Random inputs and targets of ``n`` samples; made with factory functions, so they land on the
        meta device when captured there (no memory, however large the batch)."""
        side, kind, classes = size or self.size, self.kind, self.classes

        def batch_fn(n: int) -> Any:
            if kind in ("language", "causal_lm"):
                tokens = torch.randint(0, classes, (n, side + 1))
                if kind == "causal_lm":
                    return {"idx": tokens[:, :-1], "labels": tokens[:, 1:]}
                return tokens[:, :-1], tokens[:, 1:]
            x = torch.randn(n, 3, side, side)
            if kind == "segment":
                return x, torch.randint(0, classes, (n, side, side))
            return x, torch.randint(0, classes, (n,))

        return batch_fn

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        if self.optim == "adamw":
            return torch.optim.AdamW(params, lr=1e-5)
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)


ZOO = {
    w.name: w
    for w in (
        Workload("resnet50", resnet50, 224, "classify", 1000),
        Workload("densenet121", densenet121, 224, "classify", 1000),
        Workload("vgg16", vgg16, 224, "classify", 1000),
        Workload("unet", lambda: unet(depth=4, width=64), 256, "segment", 2),
        Workload("gpt2", gpt2, 1024, "language", 50257),
        Workload("gpt2-bf16", gpt2, 1024, "language", 50257, torch.bfloat16),
        Workload("gpt2-medium-bf16", gpt2_medium, 1024, "language", 50257, torch.bfloat16),
        Workload("llama3-8b-bf16", llama3_8b, 1024, "causal_lm", 128256, torch.bfloat16, "adamw"),
        Workload("llama3-70b-bf16", llama3_70b, 1024, "causal_lm", 128256, torch.bfloat16, "adamw"),
    )
}
