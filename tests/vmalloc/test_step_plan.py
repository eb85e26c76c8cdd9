"""The step plan (Note [Step plan] in csrc/allocator_plan.cpp): a training step that repeats is learned from its
mallocs and served from a planned layout in which allocations that never live at once share physical chunks,
each at an address of its own. Once planned, a step makes no driver call, and reserved memory stays at the most
in use at once. On the host backend every allocation is written (a byte at each of its chunks) and read back
before its free, so two live allocations that shared a chunk would show; on the cuda backend against the
emulated driver (a child process, Note [cuda tests in a child process] in backends.py), which checks the
calls."""

import random

import pytest
from backends import CHUNK_SIZES, driver

import vmalloc

KiB, MiB = 1024, 1024 * 1024
CHUNKS = CHUNK_SIZES
BACKENDS = pytest.mark.parametrize("backend", ["host", "cuda"])



class Step:
    """A training step's shape: activations allocated in a forward pass (some temporaries freed early), then
    freed in reverse while differently sized gradients come and go. ``hold`` keeps one activation until the
    end of the step (a lifetime that runs longer than the plan knows)."""

    def __init__(self, arena, backend, stream, seed=0, count=12):
        self.a, self.stream, self.chunk = arena, stream, CHUNKS[backend]
        self.host = backend == "host"
        rng = random.Random(seed)
        self.sizes = [rng.randint(1, 12) for _ in range(count)]
        self.tag = 0
        self.live = {}  # addr -> (nbytes, tag)

    def malloc(self, nbytes):
        p = self.a.malloc(nbytes, self.stream)
        self.tag = self.tag % 251 + 1
        if self.host:
            buf = self.a.buffer(p, nbytes)
            for off in range(0, nbytes, self.chunk):
                buf[off] = self.tag
        self.live[p] = (nbytes, self.tag)
        return p

    def free(self, p):
        nbytes, tag = self.live.pop(p)
        if self.host:
            buf = self.a.buffer(p, nbytes)
            assert all(buf[off] == tag for off in range(0, nbytes, self.chunk)), "a live allocation was overwritten"
        self.a.free(p)

    def run(self, hold=False):
        """One iteration; returns its maps."""
        before = self.a.stats()["num_maps"]
        acts, held = [], None
        for j, k in enumerate(self.sizes):
            acts.append(self.malloc(k * self.chunk))
            if j % 3 == 2:
                p = acts.pop(len(acts) // 2)
                if hold and held is None:
                    held = p
                else:
                    self.free(p)
        while acts:
            grad = self.malloc(self.sizes[len(acts) % len(self.sizes)] * self.chunk // 2 + self.chunk)
            self.free(acts.pop())
            self.free(grad)
        if held is not None:
            self.free(held)
        return self.a.stats()["num_maps"] - before


def arena(backend, **options):
    chunk = CHUNKS[backend]
    return vmalloc.Arena(backend, capacity=options.pop("capacity", 256 * chunk), chunk_size=chunk, small_max=16 * KiB,
                         **options)  # fmt: skip


@BACKENDS
def test_a_repeated_step_is_planned_and_then_maps_nothing_at_the_peak_in_use(backend):
    with driver(backend) as stream:
        a = arena(backend)
        step = Step(a, backend, stream)
        weights = step.malloc(4 * step.chunk)
        maps = [step.run() for _ in range(8)]
        a.check_invariants()
        s = a.stats()
        step.free(weights)
    assert maps[0] > 0 and maps[-3:] == [0, 0, 0], maps
    assert s["num_plans"] == 1 and s["num_plan_hits"] > 0 and s["num_plan_misses"] == 0
    # The colors are as many as the chunks planned allocations hold at once at most (no lifetime wraps here).
    assert s["plan_colors"] == s["plan_peak_chunks"] == s["plan_chunks"]
    # Real memory: every request is whole chunks, so reserved can be exactly the peak allocated, and is.
    assert s["reserved_bytes.all.peak"] == s["allocated_bytes.all.peak"]
    assert s["slack_bytes.all.peak"] == 0


@BACKENDS
def test_a_new_step_replaces_the_plan_and_empty_cache_gives_it_back(backend):
    with driver(backend) as stream:
        a = arena(backend)
        first = Step(a, backend, stream, seed=0)
        for _ in range(6):
            first.run()
        assert a.stats()["num_plans"] == 1
        second = Step(a, backend, stream, seed=1, count=16)  # a longer period than the first
        maps = [second.run() for _ in range(7)]
        a.check_invariants()
        s = a.stats()
        assert s["num_plans_abandoned"] == 1 and s["num_plans"] == 2, s
        assert maps[-2:] == [0, 0], maps
        a.empty_cache()
        a.check_invariants()
        after = a.stats()
    assert after["plan_chunks"] == 0 and after["num_plans_abandoned"] == 2
    assert after["reserved_bytes.all.current"] == 0  # nothing live: every block goes back


@BACKENDS
def test_a_lifetime_longer_than_planned_takes_the_usual_path(backend):
    with driver(backend) as stream:
        a = arena(backend)
        step = Step(a, backend, stream)
        for _ in range(5):
            step.run()
        hits = a.stats()["num_plan_hits"]
        step.run(hold=True)  # the held activation's colors are busy when a later slot wants them
        a.check_invariants()
        s = a.stats()
        assert s["num_plan_misses"] > 0 and s["num_plan_hits"] > hits
        assert s["num_plans_abandoned"] == 0
        maps = [step.run() for _ in range(2)]
        a.check_invariants()
    assert maps[-1] == 0, maps


def test_idle_plan_chunks_yield_to_a_request_at_the_capacity():
    chunk = CHUNKS["host"]
    a = arena("host", capacity=64 * chunk)
    step = Step(a, "host", 0)
    for _ in range(5):
        step.run()
    s = a.stats()
    assert s["num_plans"] == 1 and s["plan_idle_chunks"] > 0
    # Between steps nothing is live; a request for the whole capacity needs the plan's idle chunks.
    p = a.malloc(64 * chunk)
    a.check_invariants()
    assert a.stats()["num_plans_abandoned"] == 1 and a.stats()["plan_chunks"] == 0
    a.free(p)
    step.run()
    a.check_invariants()


def test_held_bytes_count_the_plans_idle_chunks_while_a_slot_is_busy():
    # Note [Held bytes] in csrc/allocator.cpp: a plan gives its chunks back only once no slot is busy, so until
    # then its idle chunks serve no other request and are held; between steps they are free for any request.
    chunk = CHUNKS["host"]
    a = arena("host")
    step = Step(a, "host", 0)
    weights = step.malloc(4 * chunk)
    for _ in range(5):
        step.run()
    s = a.stats()
    assert s["num_plans"] == 1 and s["plan_idle_chunks"] == s["plan_chunks"] > 0
    assert a.held_bytes == 4 * chunk  # between steps: the weights alone
    hits = s["num_plan_hits"]
    first = step.malloc(step.sizes[0] * chunk)  # the period's first malloc, served from its slot
    s = a.stats()
    assert s["num_plan_hits"] == hits + 1 and s["plan_idle_chunks"] < s["plan_chunks"]
    assert a.held_bytes == (4 + s["plan_chunks"]) * chunk == s["held_bytes.all.current"]
    step.free(first)
    step.free(weights)
    a.check_invariants()


def test_no_plan_when_turned_off():
    a = arena("host", step_plan=False)
    step = Step(a, "host", 0)
    maps = [step.run() for _ in range(6)]
    assert a.stats()["num_plans"] == 0 and a.config["step_plan"] is False
    assert sum(maps[-3:]) > 0  # reclaim first without the plan: the step keeps remapping (Note [Reuse before growth])


def test_backend_failures_in_the_plan_leave_the_arena_consistent():
    """A map that fails while a slot is first mapped, and an unmap that fails while the plan is torn down
    (Note [Failure guarantees]): the malloc raises and the arena stays consistent; the unmapping is kept stuck
    and retried by empty_cache."""
    chunk = CHUNKS["host"]
    a = vmalloc.Arena("host", capacity=256 * chunk, chunk_size=chunk, small_max=16 * KiB, _test_backend=True)
    step = Step(a, "host", 0)
    for _ in range(3):  # the plan is made at the first malloc after the third copy
        step.run()
    a._inject_fault("map")
    with pytest.raises(vmalloc.BackendError):
        step.run()  # the plan is made, and its first slot fails to map
    a.check_invariants()
    assert a.stats()["num_plans"] == 1 and a.stats()["plan_idle_chunks"] > 0
    for p in list(step.live):  # what the failed iteration left live
        step.free(p)
    a.check_invariants()
    for _ in range(3):
        step.run()
    a.check_invariants()
    assert a.stats()["num_plan_hits"] > 0
    errors = a.stats()["num_backend_errors"]
    a._inject_fault("unmap")
    a.empty_cache()  # tears the plan down; its failed unmap is kept stuck, and retried by the same call
    a.check_invariants()
    s = a.stats()
    assert s["num_backend_errors"] == errors + 1 and s["plan_chunks"] == 0
    assert s["num_stuck_mappings"] == 0 and s["reserved_bytes.all.current"] == 0
