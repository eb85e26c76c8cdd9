"""swap.runtime.memory.ArenaMemory: the device memory the runtime measures when vmalloc is torch's allocator, read
from the arena's single counters (host backend here; the same counters on CUDA)."""

import vmalloc
from swap.runtime.memory import ArenaMemory

MiB = 1 << 20


def test_arena_memory_reads_allocated_bytes_and_per_window_peaks():
    arena = vmalloc.Arena(backend="host", capacity="16MiB", chunk_size="1MiB", small_max="4KiB")
    kept = arena.malloc(2 * MiB)
    memory = ArenaMemory(arena)
    assert memory.current() == arena.stats()["allocated_bytes.all.current"] == 2 * MiB
    brief = arena.malloc(3 * MiB)
    arena.free(brief)
    assert memory.current() == 2 * MiB
    assert memory.window_peak() == 5 * MiB  # what the window reached, though freed since
    assert memory.window_peak() == 2 * MiB  # a new window starts from what is live
    assert memory.peak == 5 * MiB
    arena.free(kept)
    assert memory.current() == 0
