"""Several threads allocate, write, verify and free on one arena at once (the GIL is released inside
malloc/free, so the C++ lock is what keeps the arena consistent)."""

import random
import threading

import vmalloc

KiB = 1024


def test_concurrent_alloc_free_keeps_data_and_books():
    arena = vmalloc.Arena("host", capacity="8MiB", chunk_size="64KiB", small_max="16KiB")
    errors = []
    stop = threading.Event()

    def oom_handler(nbytes):
        return False  # nothing to evict here; OOM is an allowed outcome under contention

    arena.set_oom_handler(oom_handler)

    def worker(seed):
        rng = random.Random(seed)
        live = []
        try:
            for _ in range(1500):
                if live and (rng.random() < 0.45 or len(live) > 12):
                    addr, size, tag = live.pop(rng.randrange(len(live)))
                    if bytes(arena.buffer(addr, size)) != tag * size:
                        errors.append(f"thread {seed}: allocation at {addr:#x} was overwritten")
                    arena.free(addr)
                else:
                    size = rng.choice([rng.randint(1, 16 * KiB), rng.randint(16 * KiB, 200 * KiB)])
                    try:
                        addr = arena.malloc(size, stream=seed % 3)
                    except vmalloc.OutOfMemoryError:
                        continue
                    tag = bytes([(seed * 31 + len(live)) % 256])
                    arena.buffer(addr, size)[:] = tag * size
                    live.append((addr, size, tag))
                if rng.random() < 0.01:
                    arena.empty_cache()
            for addr, _, _ in live:
                arena.free(addr)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(f"thread {seed}: {e!r}")
            stop.set()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    arena.check_invariants()
    s = arena.stats()
    assert s["allocation.all.current"] == 0 and s["num_alloc"] == s["num_free"] > 1000
