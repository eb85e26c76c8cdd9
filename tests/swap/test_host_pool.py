"""The host pool: sub-allocation with coalescing, reuse, the limit, and closing."""

import pytest
import torch

import swap
from swap.runtime.machine.host_pool import HostPool, HostPoolExhausted

MiB = 1 << 20


def test_blocks_are_reused_and_coalesced():
    pool = HostPool(pinned=False, block_size=4 * MiB)
    a, b, c = pool.alloc(MiB), pool.alloc(MiB), pool.alloc(MiB)
    a.view.fill_(1)
    b.view.fill_(2)
    assert int(a.view.sum()) == MiB and int(b.view.sum()) == 2 * MiB  # disjoint views
    pool.free(a)
    pool.free(b)  # a and b merge into one free run of 2 MiB
    d = pool.alloc(2 * MiB)
    assert (d.block, d.offset) == (a.block, a.offset)
    assert pool.reserved == 4 * MiB and pool.used == 3 * MiB
    pool.free(c)
    pool.free(d)
    assert pool.used == 0 and pool.peak_used == 3 * MiB


def test_limit_is_enforced_with_a_clear_error():
    pool = HostPool(pinned=False, limit=3 * MiB, block_size=2 * MiB)
    keep = [pool.alloc(MiB), pool.alloc(MiB), pool.alloc(MiB)]
    with pytest.raises(HostPoolExhausted, match="host_pool_limit"):
        pool.alloc(MiB)
    assert pool.reserved <= 3 * MiB
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.alloc(1)
    del keep


def test_manager_honours_host_pool_limit():
    x = torch.randn(512, 1024, requires_grad=True)
    with pytest.raises(MemoryError, match="host_pool_limit"):
        with swap.SwapManager(budget="1GiB", device="cpu", min_bytes=0, host_pool_limit="1MiB"):
            (x * 2).sigmoid().sum().backward()


def test_default_budget_on_cpu_is_available_memory_less_a_margin():
    sm = swap.SwapManager(device="cpu")
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert 0.8 * avail < sm.budget < avail
