"""Captured traces and the swap runtime: the variable sequence of a trace, and the trace under swapping.

``sequence_from_trace`` turns one iteration of a trace into the scheduler's ``swap.Sequence``: its saves
and uses, each activation's bytes, the memory that is not swappable at each step (live bytes less the
saved activations that only autograd holds), and each step's compute time: the sum of its operators' times
on a device profile (Note [Per-operator roofline], swap.forecast.pricing). Saved
storages under ``min_bytes`` are not variables, as in the runtime (``SwapManager(min_bytes=...)``): they
stay on the device and count as memory that is not swappable.

``swapped`` applies the schedule the runtime would follow for a budget: a release frees the activation's
device memory (when the forward has dropped it, else as soon as it does), a swap-in allocates it again,
and autograd's own free releases whichever copy is on the device. That is the allocation pattern the window-scheduling
paper (arXiv 2010.14109) says best-fit caching handles worst.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np

from ..capture.trace import ALLOC, FREE, ITER_BEGIN, ITER_END, SAVE, TAG, UNREF, USE, Trace
from ..devices import DeviceProfile
from ..schedule.scheduler import Schedule
from ..schedule.sequence import Sequence
from ..schedule.simulator import schedule_for
from .pricing import event_seconds

Cost = Union[DeviceProfile, np.ndarray]  # a device to price every event on, or seconds per event


def sequence_from_trace(
    trace: Trace, iteration: int = -1, cost: Optional[Cost] = None, min_bytes: int = 0
) -> Sequence:
    """The swap sequence of one iteration (default: the last, the steady state).

    ``cost``: a device profile (each event priced by ``swap.forecast.pricing.event_seconds``), or seconds per
    event of ``trace`` (e.g. ``event_seconds`` of another profile); None leaves compute at 0. A step's
    compute is the sum over the events from its access (exclusive) to the next access (inclusive); the
    events before the first access run in step 0.

    Note [Held after the last use]
    The scheduler holds a variable from its save to its last access, and drops it after that step. Autograd
    does not: the node that unpacked it keeps the tensor until its backward function returns, which is after
    the node's last unpack (BatchNorm unpacks its input, then its mean and inverse std, then computes). From
    the step after its last access until autograd frees it, a variable's bytes are therefore counted as not
    swappable. Without this the plan under-counted such steps by a whole tensor (4.3 GiB on ResNet-50 at
    batch 1440, where the swapped trace peaked 1.4 GiB above the plan); with it the plan's peak is the swapped
    trace's peak (tests/perf/test_swap_trace_accounting.py).
    """
    begin, end = trace.iterations()[iteration]
    ops, ids, sizes = trace.op.tolist(), trace.id.tolist(), trace.size.tolist()
    if cost is None:
        seconds = [0.0] * len(trace)
    else:
        seconds = (event_seconds(trace, cost) if isinstance(cost, DeviceProfile) else np.asarray(cost)).tolist()
    live = 0
    alive: dict[int, int] = {}
    for k in range(begin):
        if ops[k] == ALLOC:
            alive[ids[k]] = sizes[k]
            live += sizes[k]
        elif ops[k] == FREE and ids[k] in alive:
            live -= alive.pop(ids[k])
    last_access: dict[int, int] = {}  # allocation id -> event index of its last save/use this iteration
    for k in range(begin, end + 1):
        if ops[k] in (SAVE, USE) and sizes[k] >= min_bytes:
            last_access[ids[k]] = k
    var_of: dict[int, int] = {}
    var, kind, nbytes, nonswap, compute = [], [], [], [], []
    # Bytes of saved activations alive that the scheduler accounts for itself (Note [Held after the last use]).
    saved_alive = 0
    scheduled: set[int] = set()  # allocation ids counted in saved_alive
    expiring: list[int] = []  # ids whose last access was the step now running
    unref_step: dict[int, int] = {}  # variable -> the first step after the forward dropped it
    dropped: set[int] = set()
    interval = live
    step_cost: list[float] = []  # seconds of the events up to each access, since the previous one
    pending = 0.0  # seconds since the last access (small saves and uses are not accesses)
    for k in range(begin, end + 1):
        o, i = ops[k], ids[k]
        pending += seconds[k]
        if o == ALLOC:
            alive[i] = sizes[k]
            live += sizes[k]
        elif o == FREE:
            if i in alive:
                live -= alive.pop(i)
                if i in scheduled:
                    scheduled.discard(i)
                    saved_alive -= sizes[k]
        elif o == UNREF:
            dropped.add(i)
        elif o in (SAVE, USE):
            if sizes[k] < min_bytes:
                continue
            if var:
                nonswap.append(max(0, interval))
            for j in expiring:  # the step of their last access is over: autograd, not the plan, holds them
                if j in scheduled:
                    scheduled.discard(j)
                    saved_alive -= alive[j]
            expiring = []
            if i not in var_of:
                var_of[i] = len(nbytes)
                nbytes.append(sizes[k])
                if i in alive:
                    saved_alive += sizes[k]
                    scheduled.add(i)
            if last_access[i] == k:
                expiring.append(i)
            for j in list(dropped):
                if j in var_of:
                    unref_step.setdefault(var_of[j], len(var))
                dropped.discard(j)
            var.append(var_of[i])
            kind.append("save" if o == SAVE else "use")
            step_cost.append(pending)
            pending = 0.0
            interval = live - saved_alive
            continue
        interval = max(interval, live - saved_alive)
    if var:
        nonswap.append(max(0, interval))
    held_until = [unref_step.get(v, len(var)) for v in range(len(nbytes))]
    # The cost up to an access is the compute of the step before it; what follows the last access (the end
    # of backward, the optimizer step) runs in the last step.
    step_cost.append(pending)
    if not var:  # nothing to swap: one empty step would lose the iteration's compute, so keep none
        return Sequence([], [], [], [], [])
    for j in range(len(var)):
        # the compute before the first access (the start of the forward) runs in step 0 too
        compute.append(step_cost[j + 1] + (step_cost[0] if j == 0 else 0.0))
    return Sequence(var, kind, nbytes, nonswap, compute, held_until=held_until)


def plan_for(trace: Trace, budget: int, policy: str = "window", window: Optional[int] = None,
             cost: Optional[Cost] = None, bandwidth: float = 50e9) -> tuple[Sequence, Schedule]:  # fmt: skip
    """The sequence of ``trace`` and its schedule for ``budget`` (window policy: window chosen by simulation
    on ``bandwidth`` when not given)."""
    seq = sequence_from_trace(trace, cost=cost)
    return seq, schedule_for(seq, budget, policy, bandwidth, bandwidth, window=window).schedule


def swapped(trace: Trace, budget: int, policy: str = "window", window: Optional[int] = None,
            schedule: Optional[Schedule] = None, min_bytes: int = 0) -> Trace:  # fmt: skip
    """The trace as the swap runtime would make it under ``budget`` (its steady-state plan applied to every
    iteration with the same access sequence). ``schedule`` must be a plan of ``sequence_from_trace(trace,
    min_bytes=min_bytes)``."""
    seq = sequence_from_trace(trace, min_bytes=min_bytes)
    if schedule is None:
        schedule = plan_for(trace, budget, policy, window)[1] if min_bytes == 0 else _plan(seq, budget, policy, window)
    signature = seq.signature()
    rows: list[tuple[int, int, int, int, int]] = []  # op, id, size, tag, the source event (-1: a new one)
    next_id = int(trace.id.max()) + 1 if len(trace) else 0
    ops, ids, sizes, tags = trace.op.tolist(), trace.id.tolist(), trace.size.tolist(), trace.tag.tolist()

    def emit(o: int, i: int, s: int, tag: int = 0, k: int = -1) -> None:
        rows.append((o, i, s, tag, k))

    def is_step(k: int) -> bool:
        return ops[k] in (SAVE, USE) and sizes[k] >= min_bytes

    iteration_of = np.zeros(len(trace), dtype=np.int64) - 1
    for n, (b, e) in enumerate(trace.iterations()):
        iteration_of[b : e + 1] = n
    applies = {}
    for n, (b, e) in enumerate(trace.iterations()):
        sig = [("save" if ops[k] == SAVE else "use", sizes[k]) for k in range(b, e + 1) if is_step(k)]
        applies[n] = sig == signature
    act = TAG["activation"]
    # Per iteration state.
    var_alloc: dict[int, int] = {}  # variable -> its original allocation id (this iteration)
    device: dict[int, int] = {}  # original allocation id -> allocation now holding its bytes on the device
    released: set[int] = set()  # original ids whose device memory was released
    deferred: set[int] = set()  # released while the forward still held them: freed at UNREF
    forward_dropped: set[int] = set()
    step = 0
    for k in range(len(trace)):
        o, i = ops[k], ids[k]
        n = int(iteration_of[k])
        if o == ITER_BEGIN:
            var_alloc, device, released, deferred, forward_dropped, step = {}, {}, set(), set(), set(), 0
            emit(o, i, 0, 0, k)
            continue
        active = n >= 0 and applies.get(n, False)
        if active and is_step(k):
            if o == SAVE and i not in var_alloc.values():
                var_alloc[seq.var[step]] = i
            for v in schedule.release[step]:
                a = var_alloc[v]
                if device.get(a, a) == a:
                    if a in forward_dropped:
                        emit(FREE, a, seq.sizes[v], act)
                    else:
                        deferred.add(a)
                else:
                    emit(FREE, device[a], seq.sizes[v], act)
                device[a] = -1
                released.add(a)
            for v in schedule.swap_in[step]:
                a = var_alloc[v]
                emit(ALLOC, next_id, seq.sizes[v], act)
                device[a] = next_id
                next_id += 1
            if o == SAVE and i in deferred:  # saved again: the forward holds it, it is on the device
                deferred.discard(i)
                device[i] = i
            emit(o, i, sizes[k], 0, k)
            step += 1
            continue
        if active and o == UNREF:
            forward_dropped.add(i)
            if i in deferred:
                deferred.discard(i)
                emit(FREE, i, sizes[k], act)
            emit(o, i, sizes[k], 0, k)
            continue
        if active and o == FREE and (i in released or i in device):
            holder = device.get(i, i)
            if holder == i and i in deferred:  # never dropped by the forward before autograd freed it
                deferred.discard(i)
                emit(FREE, i, sizes[k], tags[k], k)
            elif holder >= 0 and holder != i:
                emit(FREE, holder, sizes[k], act, k)
            elif holder == i:
                emit(FREE, i, sizes[k], tags[k], k)
            device.pop(i, None)
            continue
        emit(o, i, sizes[k], tags[k] if o in (ALLOC, FREE) else 0, k)
        if o == ITER_END:
            step = 0
    a = np.array(rows, dtype=np.int64).reshape(-1, 5)
    meta = dict(trace.meta)
    meta["swap"] = {"budget": budget, "policy": schedule.policy, "window": schedule.window,
                    "planned_peak": schedule.peak, "no_swap_peak": seq.no_swap_peak()}  # fmt: skip
    src, new = np.maximum(a[:, 4], 0), a[:, 4] < 0

    def carried(x: np.ndarray, empty: float) -> np.ndarray:  # a source event's field; ``empty`` for new events
        return np.where(new, empty, x[src]).astype(x.dtype)

    return Trace(a[:, 0].astype(np.uint8), a[:, 1], a[:, 2], a[:, 3].astype(np.uint8), carried(trace.stream, 0),
                 carried(trace.flops, 0.0), carried(trace.bytes, 0.0), meta, carried(trace.module, -1),
                 carried(trace.phase, -1), carried(trace.precision, -1))  # fmt: skip


def _plan(seq: Sequence, budget: int, policy: str, window: Optional[int]) -> Schedule:
    return schedule_for(seq, budget, policy, 50e9, 50e9, window=window).schedule
