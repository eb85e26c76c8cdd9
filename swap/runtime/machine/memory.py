"""Device memory as the allocator sees it: what the budget is measured against.

``window_peak()`` returns the highest bytes in use (allocated, or vmalloc's held chunks) since the previous
call (the profiling iteration calls it at every access, to learn each step's peak); ``peak`` is the highest
seen overall; ``current()`` the bytes in use now. ``sees_inside_ops`` says whether a peak inside one operator
is seen (an allocator's count) or only live tensors between operators (the CPU meter).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .meter import LiveBytesMeter

# Note [What the over-budget count counts]
# The report's "steps over budget" (``overruns``) counts the windows of measured memory whose peak was above
# the budget: each interval between two saved-tensor accesses of a profiled or planned iteration (its last one
# through the optimizer step), each declined iteration (backward end to backward end), a report taken mid-run,
# what is left at exit, and the memory before the first iteration (one window, or one per entry the model-state
# runtime takes off the device: Note [The memory before the first iteration] in swap.runtime.activations.executor).
# Every window is read through ``window_peak``, which is also the only thing that
# raises ``peak``, so the count is above zero exactly when the report's peak is above the budget. Counted at
# the executor's steps alone, a declined run (nothing it may move, memory grown after profiling) printed a peak
# over the budget beside "steps over budget 0".


class DeviceMemory:
    """``budget``, once the executor sets it, makes ``over_budget`` count the windows read above it (Note [What
    the over-budget count counts])."""

    name = "?"
    sees_inside_ops = True

    def __init__(self) -> None:
        self.peak = 0
        self.budget: Optional[int] = None
        self.over_budget = 0  # windows whose peak was above ``budget``

    def _window_peak(self) -> int:
        raise NotImplementedError

    def current(self) -> int:
        raise NotImplementedError

    def allocation_bytes(self, nbytes: int) -> int:
        """What one allocation of ``nbytes`` counts in this memory once made (Note [Sizes as the allocator
        counts them]): the size a saved variable is planned with."""
        return nbytes

    def add_shadow(self, nbytes: int) -> None:
        """Bytes moved off the device that a run without swapping would hold (see ``shadow_window_peak``)."""

    def shadow_window_peak(self) -> Optional[int]:
        """The peak since the last call as it would be without swapping, where it can be measured; else None."""
        return None

    def add_held(self, nbytes: int) -> None:
        """Bytes freed during a step that a planned run would still hold (see ``held_window_peak``)."""

    def held_window_peak(self) -> Optional[int]:
        """The peak since the last call with the ``add_held`` bytes counted from when they were added, where
        it can be measured (call it right after ``window_peak``); else None."""
        return None

    def window_peak(self) -> int:
        p = self._window_peak()
        self.peak = max(self.peak, p)
        if self.budget is not None and p > self.budget:
            self.over_budget += 1
        return p

    def close(self) -> None:
        pass


# Note [What the CPU budget counts]
# On the CPU there is no allocator of the manager's device to ask, so the budget is measured as the bytes of
# every live CPU tensor storage in the process (a LiveBytesMeter), read between operators: the training's
# parameters, gradients, optimizer state, batches and saved tensors, and also whatever else is alive when the
# manager is entered (``track_existing``: a model trained earlier in the script, an unused ``torch.zeros``, a
# dataset held as tensors) or made while it runs. Those are not the training's, yet they are memory the run
# shares, so they count; a user who does not want them counted deletes them before entering the manager (and
# lets them be collected) or raises the budget by their size. Not counted: memory inside one operator that
# never reaches Python (a convolution's workspace: Note [What the meter cannot see] in swap.runtime.machine.meter),
# NumPy arrays and other non-tensor memory, and the pinned host pool swapped tensors go to. Storages resized
# in place (FSDP2's unsharded parameters) are counted at their new size (Note [Storages that resize]).
class MeterMemory(DeviceMemory):
    """CPU runs: live tensor bytes on the compute device, counted by a LiveBytesMeter (Note [What the CPU
    budget counts])."""

    name = "live tensor bytes between operators (LiveBytesMeter)"
    sees_inside_ops = False

    def __init__(self, device: torch.device, meter: Optional[LiveBytesMeter] = None) -> None:
        super().__init__()
        self.meter = (meter or LiveBytesMeter(device)).track_existing()
        self.meter.__enter__()
        self.meter.reset_window()
        self.meter.reset_shadow_window()

    def _window_peak(self) -> int:
        return self.meter.reset_window()

    def current(self) -> int:
        return self.meter.live

    def allocation_bytes(self, nbytes: int) -> int:
        return self.meter.storage_bytes(nbytes)

    def add_shadow(self, nbytes: int) -> None:
        self.meter.add_shadow(nbytes)

    def shadow_window_peak(self) -> Optional[int]:
        return self.meter.reset_shadow_window()

    def add_held(self, nbytes: int) -> None:
        self.meter.add_held(nbytes)

    def held_window_peak(self) -> Optional[int]:
        return self.meter.reset_held_window()

    def close(self) -> None:
        self.meter.__exit__(None, None, None)


class TorchCudaMemory(DeviceMemory):
    """torch's caching allocator counts the device's memory: window peaks from its statistics, never resetting
    the user's peak (Note [Window peaks without resetting torch's peak])."""

    name = "torch.cuda.max_memory_allocated"

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self._current, self._peak, self._allocated, self._allocations = self._read()

    def _read(self) -> tuple[int, int, int, int]:
        s = torch.cuda.memory_stats(self.device)
        return (s.get("allocated_bytes.all.current", 0), s.get("allocated_bytes.all.peak", 0),
                s.get("allocated_bytes.all.allocated", 0), s.get("allocation.all.allocated", 0))  # fmt: skip

    def _window_peak(self) -> int:
        current, peak, allocated, allocations = self._read()
        if peak > self._peak:
            p = peak  # a new high: it was reached in this window
        elif allocations == self._allocations:
            p = max(self._current, current)  # nothing allocated: the start was the highest
        else:
            p = self._current + allocated - self._allocated  # every allocation, none of the frees between them
            if peak == self._peak:  # torch's peak was not reset in between (by the user): it bounds the window
                p = min(p, peak)
        self._current, self._peak, self._allocated, self._allocations = current, peak, allocated, allocations
        return max(p, current)

    def current(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def allocation_bytes(self, nbytes: int) -> int:
        return torch_block_bytes(nbytes)


# Note [Window peaks without resetting torch's peak]
# torch's allocator keeps one peak per statistic, and ``reset_peak_memory_stats`` is the only way to start a
# new one: resetting it at every step (to learn each step's peak) would clobber the user's own
# ``torch.cuda.max_memory_allocated()``, which then reads one step's peak instead of the run's. So the peak is
# never reset; a window's peak is read from how the statistics moved across it:
# - torch's peak rose: the window reached the new peak (exact);
# - nothing was allocated: the window started at its highest (exact);
# - otherwise the memory at the start plus every byte allocated in the window, as if none of the window's frees
#   came before its last allocation. That is exact for one operator that allocates its output and workspace
#   and then frees the workspace, and otherwise an upper bound (a window of many operators, each freeing what
#   the one before allocated), never above torch's peak. An upper bound makes a plan hold more room than it
#   needs, never less.
# That cap is torch's peak for the whole process, not the manager's: a peak reached before the manager was
# entered (an earlier run in the same process) caps nothing, and a long window reads up to it. On an H200 the
# bench's "auto" run reported a peak of exactly the previous run's torch peak (6,392,730,624 bytes): its
# entry window, a bound over many allocations, was capped by the earlier run's peak (Note [The model as it
# enters] in swap.runtime.model_state.storage splits that window). A script that wants the bound tight from
# the start resets torch's peak before entering the manager, as bench/gpu/model_state_gpu.py does.
# vmalloc's arena has its own counters (ArenaMemory), exact in every window.

# torch's caching allocator (CUDACachingAllocator.cpp): every request is rounded up to 512 B; a request above
# 1 MiB comes from the large pool, whose free block is split only when more than 1 MiB would be left over, so
# the block handed out (and counted in allocated_bytes) may be up to 1 MiB larger than the rounded request.
TORCH_BLOCK_ROUND = 512
TORCH_SMALL_REQUEST = 1 << 20
TORCH_UNSPLIT_REMAINDER = (1 << 20) - TORCH_BLOCK_ROUND


def torch_block_bytes(nbytes: int) -> int:
    """The largest block torch's caching allocator may hand out (and count) for a request of ``nbytes``."""
    if nbytes <= 0:
        return 0
    size = -(-nbytes // TORCH_BLOCK_ROUND) * TORCH_BLOCK_ROUND
    return size + TORCH_UNSPLIT_REMAINDER if size > TORCH_SMALL_REQUEST else size

# Note [Sizes as the allocator counts them]
# The budget is measured in the allocator's own bytes (vmalloc's held chunks, torch's allocated bytes), and an allocator
# hands out more than a tensor asks for: vmalloc rounds a large request up to whole chunks (a 2.25 MiB
# activation holds 4 MiB: two 2 MiB chunks), torch rounds to 512 B and may hand out a large-pool block up to
# 1 MiB bigger than that when the left-over is too small to split. Planned with their own sizes, the saved
# variables a plan keeps resident beyond the profiled ones were each undercounted by their rounding. On an
# H200 the plan for a small ResNet (2.25 MiB activations) then ran over: by 0.7-1.6 % of the budget with
# torch's allocator, and into vmalloc's capacity (the budget) in global mode, where the OOM handler found no
# victim and training failed. So each variable is planned, counted on the device and evicted at
# ``allocation_bytes(nbytes)``: exact for vmalloc (``Arena.allocation_size``, the rule malloc itself uses)
# and the live-bytes meter, the largest block torch may hand out for torch's allocator (a plan then holds
# whatever block torch picks; it costs at most 1 MiB per resident variable above 1 MiB). Copies still move
# the tensor's own bytes.


# Note [vmalloc's budget is held chunks]
# With vmalloc as torch's allocator the budget is measured in its held bytes (Note [Held bytes] in
# csrc/allocator.cpp): the chunks no request can have, a slab of small blocks counted whole while any block in it
# lives. Measured in allocated bytes, the free parts of slabs counted nowhere: on an H200 the small ResNet's plan
# held 205.75 MiB allocated under a budget of 210 MiB, vmalloc's capacity, and the next 2.25 MiB activation (two
# chunks) was refused with 4.25 MiB free, fewer than two chunks of it whole; torch's allocator and a vmalloc pool
# under torch's allocator trained in the same budget. In held bytes the profile sees the slabs' free parts (in
# what is not swappable), the plan swaps enough more to leave whole chunks free, and a budget given is physical
# memory held: at a capacity equal to the budget, a request the plan allows finds its chunks.


class ArenaMemory(DeviceMemory):
    """vmalloc is the allocator: the chunks it holds for tensors (Note [vmalloc's budget is held chunks])."""

    name = "vmalloc held_bytes"

    def __init__(self, arena: Any) -> None:
        super().__init__()
        self.arena = arena
        arena.reset_peak_stats()

    def _window_peak(self) -> int:
        p = self.arena.peak_held_bytes  # single counters: stats() builds a dict of all (~10 us)
        self.arena.reset_peak_stats()
        return p

    def current(self) -> int:
        return self.arena.held_bytes

    def allocation_bytes(self, nbytes: int) -> int:
        return self.arena.allocation_size(nbytes)  # whole chunks for a large tensor


def vmalloc_arena(device: torch.device) -> Optional[Any]:
    """vmalloc's global arena for ``device`` if vmalloc is torch's CUDA allocator (global mode), else None.

    Decided by whether vmalloc is torch's *current* allocator, not by whether its arena exists yet: a
    SwapManager built before the first CUDA allocation must still measure (and evict) through vmalloc. In
    MemPool mode (``vmalloc.use_mem_pool``) torch's own allocator is current and counts the pool's memory
    too, so torch's statistics are the right measure there (TorchCudaMemory), and vmalloc must not run the
    manager as its OOM handler (Note [MemPool mode routes every thread] in vmalloc/torch_allocator.py). Nothing
    evicts or recovers there: an allocation the pool cannot serve is torch's OutOfMemoryError at once (Note
    [What a pool scope costs]), so the plan alone keeps the budget; the copy engine calls no record_stream,
    so the scope holds no freed copy back (Note [Copies without record_stream] in swap/runtime/machine/engines.py).
    """
    if device.type != "cuda":
        return None
    try:
        import vmalloc
    except ImportError:
        return None
    if not vmalloc.installed():
        return None
    return vmalloc.global_arena(device.index if device.index is not None else torch.cuda.current_device())
