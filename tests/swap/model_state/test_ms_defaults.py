"""Defaults that fit the model (Note [Bucket size by default], Note [The host pool's first block]): a 2.6 MB MLP
trains at 35 % of its plain peak with ``SwapManager(budget, model=, optimizer=)`` and nothing else, bitwise and
within the budget (in 32 MiB buckets, one bucket held the whole model and the budget was infeasible), and the
activations' host pool takes host memory in blocks sized by the budget, not 256 MiB."""

import gc

import ms_training
import pytest
import torch
import torch.nn.functional as F
from ms_training import assert_bitwise, train
from torch import nn

import swap
from swap.schedule.model_state import default_bucket_bytes


class MLP(nn.Module):
    """2.6 MB of fp32 weights, in named children (not an nn.Sequential)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(256, 512), nn.Linear(512, 512), nn.Linear(512, 512)
        self.head = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))))


def mlp_batch(model, it, n=64):
    g = torch.Generator().manual_seed(it)
    return torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)


@pytest.fixture
def mlp_loop(monkeypatch):
    monkeypatch.setattr(ms_training, "batch", mlp_batch)
    monkeypatch.setattr(ms_training, "loss_of", lambda model, x, y: F.cross_entropy(model(x), y))


def test_a_small_mlp_trains_at_35_percent_of_its_plain_peak_by_default(mlp_loop):
    weights = sum(p.numel() * p.element_size() for p in MLP().parameters())
    assert 2.5e6 < weights < 2.7e6
    meter = swap.LiveBytesMeter("cpu")
    ref = train(MLP, adamw, steps=3, meter=meter)
    budget = int(0.35 * meter.peak)
    got = train(MLP, adamw, steps=3, meter=swap.LiveBytesMeter("cpu"),
                manager=lambda m, o: swap.SwapManager(budget=budget, device="cpu", model=m, optimizer=o))  # fmt: skip
    assert_bitwise(ref, got)
    over = [(i, p - budget) for i, p in enumerate(got["peaks"]) if p > budget]
    assert not over, f"iterations over the budget of {budget} bytes: {over}"
    ms = got["manager"].report()["model_state"]
    assert ms["bucket_bytes"] == default_bucket_bytes(weights, budget) < weights // 4
    assert ms["buckets"] >= 4


def test_the_host_pool_takes_blocks_sized_by_the_budget(mlp_loop):
    """Activations swapped under a 40 MiB budget take host memory in blocks of 10 MiB, not one of 256 MiB."""
    # The CPU budget counts every live storage (Note [What the CPU budget counts]): the test before this one
    # leaves its managed run in reference cycles that only the collector frees.
    gc.collect()
    budget = 40 << 20
    with swap.SwapManager(budget=budget, device="cpu", policy="all", min_bytes=0) as sm:
        model = MLP()
        for it in range(3):
            x, y = mlp_batch(model, it, n=2048)
            F.cross_entropy(model(x), y).backward()
    r = sm.report()
    assert r["swapped_out_bytes"] > 0
    assert 0 < r["host_pool_bytes"] <= 2 * budget, r["host_pool_bytes"]
