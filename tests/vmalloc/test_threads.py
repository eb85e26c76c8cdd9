"""Several threads allocate, write, verify and free on one arena at once (the GIL is released inside
malloc/free, so the C++ lock is what keeps the arena consistent), on the host backend and on the cuda
backend against the emulated driver (stream work, race detector)."""

import random
import threading

import pytest
from backends import memory_for
from run_summary import SUMMARY

import vmalloc

KiB = 1024


@pytest.mark.parametrize("backend", ["host", "cuda"])
def test_concurrent_alloc_free_keeps_data_and_books(backend):
    memory = memory_for(backend)
    chunk = 64 * KiB if backend == "host" else 2 << 20
    small = 16 * KiB if backend == "host" else 256 * KiB
    arena = memory.arena(capacity=128 * chunk, chunk_size=chunk, small_max=small)
    errors = []
    arena.set_oom_handler(lambda nbytes: False)  # nothing to evict; OOM is an allowed outcome under contention
    steps = 1500 if backend == "host" else 400

    def worker(seed):
        rng = random.Random(seed)
        live = []
        stream = memory.streams[seed % len(memory.streams)]
        try:
            memory.thread_init()
            for _ in range(steps):
                if live and (rng.random() < 0.45 or len(live) > 12):
                    addr, size, tag = live.pop(rng.randrange(len(live)))
                    memory.check(stream, addr, size, tag)
                    arena.free(addr)
                else:
                    size = rng.choice([rng.randint(1, small), rng.randint(small, 3 * chunk)])
                    try:
                        addr = arena.malloc(size, stream=stream)
                    except vmalloc.OutOfMemoryError:
                        continue
                    memory.handed_out(stream, addr, size)
                    tag = (seed * 31 + len(live)) % 255 + 1
                    memory.write(stream, addr, size, tag, rng)
                    live.append((addr, size, tag))
                if rng.random() < 0.01:
                    arena.empty_cache()
            for addr, size, tag in live:
                memory.check(stream, addr, size, tag)
                arena.free(addr)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(f"thread {seed}: {e!r}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    arena.check_invariants()
    s = arena.stats()
    assert s["allocation.all.current"] == 0 and s["num_alloc"] == s["num_free"] > 6 * steps // 3
    arena.empty_cache()
    arena = None  # destroyed (its fences waited for) before the emulator checks for races
    memory.finish()
    SUMMARY.count_ops(backend, s["num_alloc"] + s["num_free"])
