"""Which driver calls vmalloc makes in each step of a training iteration, and what they cost.

``step_work`` replays a trace (usually a swapped one, swap.forecast.from_trace.swapped) through vmalloc's real
allocator core on the sim backend and attributes every chunk map, unmap, create and release to the step in
which the allocator made it: the calls made between access i and access i+1 of the iteration belong to
step i (the allocations of step i's operators, and the swap-ins and releases issued before access i+1).
Calls before the iteration's first access go to step 0, calls after its last access to the last step.
``seconds`` prices them with bench.vmm_costs; swap.schedule.simulator charges them on the compute stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import vmalloc
from bench.vmm_costs import VmmCosts
from swap.capture import ALLOC, FREE, SAVE, USE, Trace

# Driver calls, except creation, counted in chunks: its cost grows with bytes (Note [VMM cost figures]).
KEYS = ("num_maps", "num_unmaps", "num_created_chunks", "num_device_free")


@dataclass
class StepWork:
    """Per step of one iteration: map, unmap and release calls, and chunks created (the allocator's counters)."""

    maps: list[int]
    unmaps: list[int]
    creates: list[int]
    releases: list[int]
    ok: bool = True  # False: the replay ran out of memory (the counts stop there)
    totals: dict[str, int] = field(default_factory=dict)  # the same counters over the whole iteration

    def seconds(self, costs: VmmCosts) -> list[float]:
        """Host seconds of driver calls per step."""
        return [costs.seconds(m, u, c, r) for m, u, c, r in zip(self.maps, self.unmaps, self.creates, self.releases)]


def step_work(trace: Trace, capacity: Optional[int] = None, chunk_size: str | int = "2MiB",
              iteration: int = -1) -> StepWork:  # fmt: skip
    """Replays ``trace`` on a fresh vmalloc sim arena of ``capacity`` bytes (None: unlimited) and counts, per
    access step of ``iteration`` (default: the last, the steady state), the allocator's driver calls."""
    arena = vmalloc.Arena("sim", capacity=capacity or (4 << 40), chunk_size=chunk_size)
    iters = trace.iterations()
    if not iters:
        raise ValueError("the trace has no iteration (no iteration begin/end events)")
    begin, end = iters[iteration]
    ops, ids, sizes, streams = trace.op.tolist(), trace.id.tolist(), trace.size.tolist(), trace.stream.tolist()
    nsteps = sum(1 for o in ops[begin : end + 1] if o in (SAVE, USE))
    per = {k: [0] * max(1, nsteps) for k in KEYS}
    addr: dict[int, int] = {}
    step, ok = 0, True

    def counters() -> dict[str, int]:
        s = arena.stats()
        return {k: s[k] for k in KEYS}

    last: dict[str, int] = {}

    def close_step() -> None:  # the calls since the previous access belong to the step it started
        nonlocal last
        now = counters()
        for key in KEYS:
            per[key][max(0, step - 1)] += now[key] - last[key]
        last = now

    for k in range(end + 1):
        o, i, s, st = ops[k], ids[k], sizes[k], streams[k]
        if k == begin:
            last = counters()
        if o == ALLOC:
            try:
                addr[i] = arena.malloc(s, st)
            except vmalloc.OutOfMemoryError:
                ok = False
                break
        elif o == FREE:
            a = addr.pop(i, None)
            if a is not None:
                arena.free(a)
        elif k >= begin and o in (SAVE, USE):
            close_step()
            step += 1
    if ok:
        close_step()
    totals = {key: sum(per[key]) for key in KEYS}
    return StepWork(per["num_maps"], per["num_unmaps"], per["num_created_chunks"], per["num_device_free"], ok, totals)
