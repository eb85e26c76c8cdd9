"""swap.runtime.machine.memory: the device memory the runtime measures. ArenaMemory when vmalloc is torch's allocator,
read from the arena's single counters (host backend here; the same counters on CUDA); TorchCudaMemory with
torch's own allocator, read from its statistics without resetting the user's peak (an allocator's statistics
stand in for CUDA here)."""

import pytest
import torch

import vmalloc
from swap.runtime.machine.memory import ArenaMemory, TorchCudaMemory

KiB, MiB = 1 << 10, 1 << 20


def test_arena_memory_reads_held_bytes_and_per_window_peaks():
    arena = vmalloc.Arena(backend="host", capacity="16MiB", chunk_size="1MiB", small_max="4KiB")
    kept = arena.malloc(2 * MiB)
    memory = ArenaMemory(arena)
    assert memory.current() == arena.stats()["held_bytes.all.current"] == 2 * MiB
    brief = arena.malloc(3 * MiB)
    arena.free(brief)
    assert memory.current() == 2 * MiB
    assert memory.window_peak() == 5 * MiB  # what the window reached, though freed since
    assert memory.window_peak() == 2 * MiB  # a new window starts from what is live
    assert memory.peak == 5 * MiB
    arena.free(kept)
    assert memory.current() == 0


def test_arena_memory_counts_a_slab_whole_while_a_block_in_it_lives():
    # Note [Held bytes] in csrc/allocator.cpp: on an H200 a plan that held vmalloc's allocated bytes within a
    # capacity equal to its budget was refused 2.25 MiB, the free parts of slabs out of reach. The budget counts
    # the chunks held: a slab with a block in use is a whole chunk of it.
    arena = vmalloc.Arena(backend="host", capacity="8MiB", chunk_size="1MiB", small_max="512KiB")
    memory = ArenaMemory(arena)
    small = [arena.malloc(512 * KiB) for _ in range(4)]
    arena.free(small[0])
    arena.free(small[2])
    assert arena.allocated_bytes == MiB
    assert memory.current() == 2 * MiB and memory.window_peak() == 2 * MiB
    assert memory.allocation_bytes(MiB + 1) == 2 * MiB  # a large request: whole chunks
    arena.free(small[1])
    arena.free(small[3])
    assert memory.current() == 0


class TorchStatistics:
    """torch's CUDA allocator statistics as torch.cuda's functions read them, over allocations the test makes."""

    def __init__(self):
        self.current = self.peak = self.allocated = self.allocations = 0
        self.resets = 0

    def alloc(self, n):
        self.current += n
        self.allocated += n
        self.allocations += 1
        self.peak = max(self.peak, self.current)

    def free(self, n):
        self.current -= n

    def memory_stats(self, device=None):
        return {"allocated_bytes.all.current": self.current, "allocated_bytes.all.peak": self.peak,
                "allocated_bytes.all.allocated": self.allocated, "allocation.all.allocated": self.allocations}

    def reset_peak_memory_stats(self, device=None):
        self.resets += 1
        self.peak = self.current


@pytest.fixture
def torch_cuda(monkeypatch):
    stats = TorchStatistics()
    monkeypatch.setattr(torch.cuda, "memory_stats", stats.memory_stats)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: stats.peak)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: stats.current)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", stats.reset_peak_memory_stats)
    return stats


def test_torch_cuda_memory_never_resets_the_users_peak(torch_cuda):
    torch_cuda.alloc(8 * MiB)
    torch_cuda.free(8 * MiB)  # the user's run before the manager: torch.cuda.max_memory_allocated() is 8 MiB
    torch_cuda.alloc(MiB)
    memory = TorchCudaMemory(torch.device("cuda", 0))
    torch_cuda.alloc(2 * MiB)  # an output, then a workspace freed: one operator
    torch_cuda.alloc(3 * MiB)
    torch_cuda.free(3 * MiB)
    assert memory.window_peak() == 6 * MiB  # exact: every allocation before the free
    assert memory.window_peak() == 3 * MiB  # nothing allocated: what is live
    torch_cuda.alloc(7 * MiB)  # a new high (10 MiB): exact
    torch_cuda.free(7 * MiB)
    assert memory.window_peak() == 10 * MiB
    for _ in range(3):  # three operators, each freeing what the one before made: bounded by torch's peak
        torch_cuda.alloc(4 * MiB)
        torch_cuda.free(4 * MiB)
    assert 7 * MiB <= memory.window_peak() <= 10 * MiB
    assert memory.current() == 3 * MiB and memory.peak == 10 * MiB
    assert torch_cuda.resets == 0 and torch.cuda.max_memory_allocated() == 10 * MiB, "the user's peak was reset"
