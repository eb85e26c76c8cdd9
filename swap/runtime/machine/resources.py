"""What the manager measures and moves with on its device: the budget's default and ceiling, the device-memory
source the budget is measured against, the copy engine and the host pool."""

from __future__ import annotations

import gc
import os
import sys
from typing import Any, Optional

import torch

from ...schedule.budget import InfeasibleBudget, refuse_over_memory
from ...units import size_arg
from .engines import CudaEngine, HostEngine
from .host_pool import HostPool
from .memory import ArenaMemory, DeviceMemory, MeterMemory, TorchCudaMemory


def available_host_memory() -> int:
    """Host memory available now (MemAvailable), else half the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def default_budget(device: torch.device, arena: Any) -> int:
    """``budget=None``: vmalloc's capacity when vmalloc is the CUDA allocator, else the device's free memory less
    10% (CPU runs: available host memory less 10%)."""
    if arena is not None:
        return int(arena.capacity)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free - total // 10)
    return int(available_host_memory() * 0.9)


def refuse_budget_above_memory(budget: int, device: torch.device, arena: Any) -> None:
    """Note [A budget above the device's memory] (swap/schedule/budget.py): on a CUDA device, vmalloc's
    capacity (when it is the allocator) or else the device's total memory; nothing on the CPU."""
    if device.type != "cuda":
        return
    if arena is not None:
        limit, what = int(arena.capacity), f"vmalloc's capacity on {device}"
        otherwise = ("budget=None (the capacity); or raise the capacity (arena.set_capacity(...), or "
                     "vmalloc.configure(capacity=...) before the first CUDA allocation)")  # fmt: skip
    else:
        limit = int(torch.cuda.get_device_properties(device).total_memory)
        what = f"the memory of {device}"
        otherwise = "budget=None (free memory less 10%)"
    refuse_over_memory(budget, limit, what, f"pass budget={size_arg(limit)!r} or less, or {otherwise}")


# Note [Retrying inside except InfeasibleBudget]
# Users retry where they catch: ``except swap.InfeasibleBudget as e: train(budget=e.min_budget)``. While that
# except block runs, the exception's traceback holds every frame it passed through: the failed run's training
# function (its model, optimizer and batch), the model's forward calls (their activations; a finished frame
# also keeps its function, and torch's Module._call_impl closure keeps the module's arguments) and the hooks.
# The retry's manager would measure those tensors as memory it cannot move, so its smallest budget is larger
# than the e.min_budget it was given and it fails again (a U-Net: "not swappable" 1.10 MiB, then 2.34 MiB).
# So a manager that starts while an InfeasibleBudget is being handled (itself, or as the cause or context of
# the exception handled, as torch_oom raises it) first cuts the traceback of each exception in that chain down
# to the frames still running (the one that caught it, and its callers), and collects the garbage: the failed
# run's frames go with their tensors, and the traceback, if printed later, ends where it was caught. Clearing
# the frames' locals instead (traceback.clear_frames) leaves the closures, and with them a module's input.
#
# Note [Retrying after except InfeasibleBudget]
# A retry after the except block (a loop's next pass: ``for attempt in ...: try: train(...) except
# InfeasibleBudget as e: budget = e.min_budget``) finds no exception being handled, yet the failed run is still
# alive: its frames, the traceback and the manager's hooks refer to one another, and only Python's cycle
# collector frees them, whenever it next runs. The refused manager's exit put the model back on the device (its
# weights in the master dtype, with the gradients of the micro-batch it ran), so the retry counted them as memory
# it could not move: on an H200 a 200M model measured 1.20 GiB, was retried at 1.26 GiB and refused at 2.69 GiB
# ("1.53 GiB not swappable": about its fp32 weights and gradients, 2 x 803 MB). So a manager that exits
# with an InfeasibleBudget marks it (``note_refused``), and the next manager to start collects the garbage first.
# An exception the caller still holds after its except block (``err = e``) keeps its frames: nothing here can
# cut a traceback it no longer sees being handled; delete it before retrying.
_refused = [False]


def note_refused() -> None:
    """A manager exits with an ``InfeasibleBudget`` (Note [Retrying after except InfeasibleBudget])."""
    _refused[0] = True


def release_failed_run() -> bool:
    """Note [Retrying inside except InfeasibleBudget] and Note [Retrying after except InfeasibleBudget];
    whether an ``InfeasibleBudget`` was being handled, or a manager had exited with one since the last start."""
    chain: list[BaseException] = []
    handled = sys.exc_info()[1]
    while handled is not None and all(handled is not e for e in chain):
        chain.append(handled)
        handled = handled.__cause__ or handled.__context__
    refused, _refused[0] = _refused[0], False
    if not any(isinstance(e, InfeasibleBudget) for e in chain):
        if refused:
            gc.collect()
        return refused
    running: set[int] = set()  # the frames of this thread's stack, which must keep their entries
    frame: Any = sys._getframe()
    while frame is not None:
        running.add(id(frame))
        frame = frame.f_back
    for e in chain:
        e.__traceback__ = _running_part(e.__traceback__, running)
    gc.collect()  # the failed run's hooks, executor and graph refer to each other
    return True


def _running_part(tb: Any, running: set[int]) -> Any:
    """The entries of traceback ``tb`` whose frames still run (those that catch it), without the rest."""
    if tb is None or id(tb.tb_frame) not in running:
        return None
    last = tb
    while last.tb_next is not None and id(last.tb_next.tb_frame) in running:
        last = last.tb_next
    last.tb_next = None
    return tb


# Note [The host pool's first block]
# The activations' host pool takes host memory a block at a time (each block one registration when pinned). Its
# blocks are a quarter of the budget, between 2 MiB and 256 MiB: what a run swaps grows with what it trains, so
# a small run (a 6 MiB model) takes a few MiB at a time, not 256 MiB beside a host-memory prediction that never
# counted them, and a large one still pins in few, large blocks.
def host_block_bytes(budget: Optional[int]) -> int:
    """Note [The host pool's first block] (None: no budget known, the largest block)."""
    return 256 << 20 if budget is None else max(2 << 20, min(256 << 20, budget // 4))


def open_resources(
    device: torch.device, arena: Any, host_pool_limit: Optional[int]
) -> tuple[DeviceMemory, Any, HostPool]:
    """The device-memory source (vmalloc's arena, torch's CUDA statistics, or a live-bytes meter on the CPU),
    the copy engine and the host pool (pinned on CUDA) for ``device``."""
    release_failed_run()  # before the memory is measured
    cuda = device.type == "cuda"
    if cuda:
        memory: DeviceMemory = ArenaMemory(arena) if arena is not None else TorchCudaMemory(device)
        engine: Any = CudaEngine(device)
    else:
        memory = MeterMemory(device)
        engine = HostEngine()
    return memory, engine, HostPool(pinned=cuda, limit=host_pool_limit)
