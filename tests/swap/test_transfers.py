"""The executor's copies on the host engine: releases never make the host wait (Note [Releases without host
waits]), spare host blocks stay bounded when shapes change (Note [Host block reuse]), and a host block is not
overwritten while a copy to the device still reads it (Note [Host block fences])."""

import threading
import time

import pytest
import torch

import swap
from swap.runtime.activations.lifecycle import PLANNED, Counters
from swap.runtime.activations.tracer import Variable
from swap.runtime.activations.transfers import Transfers
from swap.runtime.machine.engines import HostEngine
from swap.runtime.machine.host_pool import HostPool

MiB = 1 << 20


def room(nbytes: int) -> int:
    """A CPU budget of ``nbytes`` for the training, on top of what the process holds already: the budget counts
    every live storage (Note [What the CPU budget counts]), and what earlier tests in the same process left
    alive differs between a serial run and each parallel worker (Note [Tests in parallel] in the Makefile)."""
    return swap.LiveBytesMeter("cpu").track_existing().live + nbytes


def mlp(layers: int = 4, width: int = 256) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.GELU())])


def test_planned_iterations_make_no_host_waits():
    """Every release used to wait on the host for its copy (cudaEventSynchronize on a GPU): the CPU ran in
    lockstep with the copies. A device-side wait orders any reuse of the memory after the copy."""
    budget = room(5_000_000)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    per_iteration = []
    with swap.SwapManager(budget=budget, device="cpu", policy="window", min_bytes=0) as sm:
        engine = sm.executor.engine
        waited = []
        wait_host = engine.wait_host
        engine.wait_host = lambda ticket: (waited.append(ticket), wait_host(ticket))[1]
        for _ in range(6):
            before = len(waited)
            model(torch.randn(512, 256)).sum().backward()
            opt.step()
            opt.zero_grad()
            per_iteration.append((sm.executor.mode, len(waited) - before))
        out = sm.executor.counters.swapped_out_bytes
    planned = [n for mode, n in per_iteration if mode == PLANNED]
    assert len(planned) >= 3 and out > 0, per_iteration
    assert planned == [0] * len(planned), f"host waits per planned iteration: {per_iteration}"
    assert engine.host_waits == 0


def test_spare_host_blocks_stay_bounded_under_cycling_shapes():
    """20 batch sizes in turn: spare blocks kept by exact size grew to one iteration's swapped bytes per shape
    ever seen (1.7 -> 50 MiB here), all of it page-locked on a GPU."""
    budget = room(6_000_000)
    model = mlp(layers=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sizes = [256 + 16 * k for k in range(20)]
    spare, used, swapped = [], [], []
    with swap.SwapManager(budget=budget, device="cpu", policy="window", min_bytes=0) as sm:
        ex = sm.executor
        for it in range(24):
            before = ex.counters.swapped_out_bytes
            model(torch.randn(sizes[it % len(sizes)], 256)).sum().backward()
            opt.step()
            opt.zero_grad()
            swapped.append(ex.counters.swapped_out_bytes - before)
            used.append(ex.pool.used)  # what is swapped out now, and the spare blocks
            spare.append(getattr(ex.transfers, "spare_host_bytes", 0))
    most = max(swapped)
    assert most > 0
    assert max(used) <= 3 * most, f"host pool in use {max(used) / MiB:.1f} MiB, one iteration swaps {most / MiB:.1f}"
    # What a block waits in: the iteration that freed it, and one more (the next iteration takes it, or not).
    assert max(spare) <= 2 * most


class DeviceSideWaits(HostEngine):
    """A host engine whose ``wait_compute`` returns at once, as a GPU's does when the compute stream is not the
    one the next copy waits on (a model with side streams): only ``after`` fences order the copies then."""

    def wait_compute(self, ticket):
        return 0.0


def variable(vid: int, t: torch.Tensor) -> Variable:
    var = Variable(vid, t.untyped_storage(), t.device, 1)
    var.attach(t.untyped_storage())
    return var


def test_a_reused_host_block_waits_for_the_copy_that_reads_it():
    engine = DeviceSideWaits(inline_bytes=0)
    pool = HostPool(pinned=False, block_size=8 * MiB)
    lock = threading.RLock()
    moves = Transfers(torch.device("cpu"), engine, pool, Counters(), lock, lambda var: None, lambda *a: None)
    n = 4 * MiB
    a_data, b_data = torch.full((n,), 7, dtype=torch.uint8), torch.full((n,), 9, dtype=torch.uint8)
    a = variable(0, a_data.clone())
    moves.swap_out(a, 0)
    moves.release(a, 1)
    gate = threading.Event()
    engine._h2d.submit(gate.wait)  # the copy back queues behind this, still to read the host block
    moves.swap_in(a, 2)
    fetched = a.dev
    moves.ensure_resident(a, 3)  # waited for on "another stream": returns at once
    a.alive = False
    moves.retire(a)  # its host block is spare now, its copy back still to run
    b = variable(1, b_data.clone())
    moves.swap_out(b, 4)  # takes the same host block
    time.sleep(0.2)  # without a fence, b's copy to host overwrites the block now
    gate.set()
    engine.drain()
    assert b.host.view.data_ptr() == pool._blocks[0].ctypes.data, "the test needs b to reuse a's block"
    assert torch.equal(fetched, a_data), "a's copy back read the host block after b's copy overwrote it"
    assert torch.equal(b.host.view, b_data)
    engine.close()


@pytest.mark.parametrize("nbytes", [MiB, 1024])
def test_a_copy_after_another_waits_for_it(nbytes):
    """``after`` on the host engine: for a copy on the worker, and for one small enough to run inline."""
    engine = HostEngine(inline_bytes=64 << 10)
    gate = threading.Event()
    engine._h2d.submit(gate.wait)
    block = torch.full((MiB,), 3, dtype=torch.uint8)
    dst = torch.empty(MiB, dtype=torch.uint8)
    first = engine.h2d(dst, block)  # queued behind the gate
    threading.Timer(0.2, gate.set).start()
    engine.d2h(block[:nbytes], torch.zeros(nbytes, dtype=torch.uint8), after=first)
    engine.drain()
    assert int(dst.sum()) == 3 * MiB, "the copy to the device read the block after it was overwritten"
    assert int(block.sum()) == 3 * (MiB - nbytes)
    engine.close()
