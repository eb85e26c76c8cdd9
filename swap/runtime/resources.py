"""What the manager measures and moves with on its device: the budget's default and ceiling, the device-memory
source the budget is measured against, the copy engine and the host pool."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from ..schedule.budget import refuse_over_memory
from ..units import size_arg
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


def open_resources(
    device: torch.device, arena: Any, host_pool_limit: Optional[int]
) -> tuple[DeviceMemory, Any, HostPool]:
    """The device-memory source (vmalloc's arena, torch's CUDA statistics, or a live-bytes meter on the CPU),
    the copy engine and the host pool (pinned on CUDA) for ``device``."""
    cuda = device.type == "cuda"
    if cuda:
        memory: DeviceMemory = ArenaMemory(arena) if arena is not None else TorchCudaMemory(device)
        engine: Any = CudaEngine(device)
    else:
        memory = MeterMemory(device)
        engine = HostEngine()
    return memory, engine, HostPool(pinned=cuda, limit=host_pool_limit)
