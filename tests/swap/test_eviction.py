"""The allocator's OOM handler (swap.runtime.activations.eviction): what it frees, in which order (Note [Evicting a
prefetch])."""

import threading
from types import SimpleNamespace

from swap.runtime.activations.eviction import evict_lru


def _executor(step, vars_):
    released = []

    def release(v):
        released.append(v.name)
        v.dev = v.h2d = None

    return SimpleNamespace(lock=threading.RLock(), closed=False, step=step, vars=vars_,
                           transfers=SimpleNamespace(release=release), counters=SimpleNamespace(evictions=0),
                           released=released)  # fmt: skip


def _var(name, last_access, prefetched=False, resident=True):
    return SimpleNamespace(name=name, last_access=last_access, size=100, dev=object() if resident else None,
                           h2d=object() if prefetched else None)  # fmt: skip


def test_idle_variables_go_first_then_prefetches_never_the_steps_own():
    ex = _executor(step=6, vars_=[
        _var("prefetched early", 1, prefetched=True), _var("idle", 3), _var("idle oldest", 0),
        _var("in use now", 5), _var("prefetched", 4, prefetched=True), _var("gone", 2, resident=False),
    ])  # fmt: skip
    assert evict_lru(ex, 150)
    assert ex.released == ["idle oldest", "idle"]
    # Nothing idle is left: a prefetch is dropped (fetched again on demand) rather than the allocation failing.
    assert evict_lru(ex, 150)
    assert ex.released[2:] == ["prefetched early", "prefetched"] and ex.counters.evictions == 4
    assert not evict_lru(ex, 100), "the variable the step uses stays"
