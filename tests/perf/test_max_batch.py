"""The largest batch is found exactly, by the benchmark (candidates, then bisection) and by swap.plan alike."""

import pytest

import swap
from bench.swap_schedule import fits, max_batch
from bench.vmm_costs import for_device
from swap.devices import profile
from swap.forecast.zoo import ZOO

MODEL, SIZE, BUDGET = "unet", 64, 640 << 20  # weights, gradients and momentum take 357 MiB of it
CANDIDATES = [8, 16, 32, 64, 128, 256]
DEV = profile("v100")
COSTS = for_device("v100")


@pytest.fixture(scope="module")
def planned():
    w = ZOO[MODEL]
    return {
        alloc: swap.plan(w.model_fn(), w.batch_fn(SIZE), budget=BUDGET, device="v100", allocator=alloc,
                         optimizer=w.optimizer, policies=("window",), min_bytes=0, steps=3, progress=False,
                         strategies=())
        for alloc in ("vmalloc", None)
    }  # fmt: skip


@pytest.mark.parametrize("column,allocator", [("window", None), ("window+vmalloc", "vmalloc")])
def test_the_benchmarks_largest_batch_is_exact_and_the_planners(planned, column, allocator):
    n = max_batch(MODEL, CANDIDATES, column, DEV, BUDGET, COSTS, SIZE)
    assert n not in CANDIDATES  # between two candidates: the bisection, not the grid, found it
    assert fits(MODEL, n, column, DEV, BUDGET, COSTS, SIZE)
    assert not fits(MODEL, n + 1, column, DEV, BUDGET, COSTS, SIZE)
    assert planned[allocator].max_batch["window"] == n  # python -m swap.plan shows the same batch
