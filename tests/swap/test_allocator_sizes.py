"""A plan counts saved tensors as the allocator does (Note [Sizes as the allocator counts them] in
swap/runtime/machine/memory.py). On a GPU the budget is the allocator's bytes: vmalloc rounds a large tensor up to
whole chunks, torch's allocator to its block. Here a live-bytes meter that counts storages as vmalloc does
(small ones in 512 B steps, larger ones in whole chunks) stands in for the allocator, on the CPU: it is both the
manager's measure and the independent one."""

import warnings

import pytest
import torch
import training

import swap
import swap.runtime.manager as manager_module
from swap.runtime.machine.memory import MeterMemory, torch_block_bytes
from swap.runtime.machine.meter import LiveBytesMeter

KiB, MiB = 1024, 1 << 20
CHUNK = 64 * KiB
WIDTH, BATCH = 64, 260  # each activation is 66,560 bytes: two chunks once rounded, nearly twice its size


class ChunkedMeter(LiveBytesMeter):
    """Live bytes as vmalloc counts them: small storages in 512 B steps, larger ones in whole chunks."""

    def storage_bytes(self, nbytes: int) -> int:
        step = 512 if nbytes <= CHUNK // 2 else CHUNK
        return -(-nbytes // step) * step


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(8)),
                               torch.nn.Linear(WIDTH, 10))  # fmt: skip


def _batch(model: torch.nn.Module, it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(it)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


@pytest.fixture
def chunked_allocator(monkeypatch):
    """The manager measures the device with the chunked meter, as it reads vmalloc's counters on a GPU."""
    plain = manager_module.open_resources

    def open_resources(device, arena, host_pool_limit):
        memory, engine, pool = plain(device, arena, host_pool_limit)
        memory.close()
        return MeterMemory(device, ChunkedMeter(device)), engine, pool

    monkeypatch.setattr(manager_module, "open_resources", open_resources)


def test_a_plan_holds_its_budget_when_the_allocator_rounds_up(chunked_allocator):
    base = training.run("mlp", iterations=6, meter=ChunkedMeter("cpu"), build=_mlp, batch_fn=_batch)
    budget = int(0.7 * max(base["peaks"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", swap.BudgetWarning)  # an overrun, planned or profiled, fails the test
        run = training.run("mlp", iterations=6, meter=ChunkedMeter("cpu"), build=_mlp, batch_fn=_batch,
                           manager=lambda: swap.SwapManager(budget=budget, policy="window", min_bytes=0))  # fmt: skip
    report = run["manager"].report()
    assert report["swapped_out_bytes"] > 0 and not report["declined"], report
    training.assert_within(run["peaks"], budget)
    assert report["peak_device_bytes"] <= budget, report
    training.assert_bitwise_equal(base, run)


def test_torch_allocators_block_is_the_size_planned():
    # TorchCudaMemory's sizes: torch rounds to 512 B, and a large-pool block left unsplit holds up to 1 MiB more.
    assert [torch_block_bytes(n) for n in (0, 1, 512, 513, MiB)] == [0, 512, 512, 1024, MiB]
    assert torch_block_bytes(MiB + 1) == MiB + 512 + MiB - 512
    assert torch_block_bytes(9 * MiB // 4) == 9 * MiB // 4 + MiB - 512
