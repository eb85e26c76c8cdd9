"""The locks that garbage-collection callbacks take are re-entrant: a callback can run on the thread that
already holds the lock (a storage dying while the lock's owner allocates), and must not deadlock it."""

import threading

import torch

import swap
from swap.runtime.machine.host_pool import HostPool


def finishes(fn, timeout: float = 10.0) -> bool:
    """Runs ``fn`` in a daemon thread; False if it is still running after ``timeout`` (deadlocked)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


def test_a_storage_dying_while_the_executor_holds_its_counts_lock():
    with swap.SwapManager(budget="1GiB", device="cpu", min_bytes=0) as sm:
        ex = sm.executor
        holder = [torch.ones(4096)]
        ex.note_kept(holder[0])  # profiling: counted, with a weakref callback on its storage
        assert ex.kept.bytes == 4096 * 4

        def dies_under_the_lock():
            with ex.kept.lock:  # the executor's counts lock
                holder.clear()  # the last reference: the callback runs here and takes it again

        assert finishes(dies_under_the_lock), "the storage's callback deadlocked on the executor's counts lock"
        assert ex.kept.bytes == 0


def test_a_block_freed_by_a_finalizer_while_the_pool_lock_is_held():
    pool = HostPool(pinned=False, block_size=1 << 20)
    hb = pool.alloc(4096)

    def freed_under_the_lock():
        with pool._lock:  # e.g. alloc() making a tensor, which runs the cyclic GC and a variable's finalizer
            pool.free(hb)

    assert finishes(freed_under_the_lock), "HostPool.free deadlocked on the pool's lock"
    assert pool.used == 0
    pool.close()
