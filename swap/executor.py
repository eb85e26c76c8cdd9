"""The executor: runs inside the saved-tensor hooks and moves variables as the schedule says.

Each pack and unpack is one step. In a *planned* iteration, step i issues ``release[i]`` (wait for the D2H
copy, drop the device copy), ``swap_in[i]`` (start H2D), the access (a use waits for its H2D copy, or
fetches on demand if the plan missed: slower, never wrong), then ``swap_out[i]`` (start D2H). A *profiling*
iteration runs the conservative plan instead: every
variable's copy starts as soon as it is saved and it leaves the device at the next step; a use prefetches
the variable saved just before it (backward mostly runs the forward in reverse). Meanwhile it records the
sequence the scheduler plans the next iterations with.

Note [Two profiling iterations]
The first iteration is not representative: gradients and optimizer state (momentum, Adam moments) are made
during it, so the memory that is not ours to move is larger in every later iteration. The executor
therefore profiles two iterations, both with the conservative plan, and plans from the element-wise larger
of the two. After the sequence changes, one profiling iteration suffices (the state exists by then). And if
a planned iteration's measured peak ever exceeds the budget, the next iteration profiles again.

Note [Iteration boundaries]
An iteration ends when autograd finishes a backward pass: the first unpack queues an engine callback. The
next pack starts a new iteration, numbering its variables afresh in save order, so a repeated training step
reproduces the profiled sequence step for step; the first step that differs (shape, order) switches the
rest of the iteration to the conservative plan and makes the next one a profiling iteration.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

import torch

from .host_pool import HostPool
from .memory import DeviceMemory
from .scheduler import InfeasibleBudget, Schedule
from .sequence import SAVE, USE, Sequence
from .tracer import Packed, Variable

log = logging.getLogger("swap")

PROFILE, PLANNED, FALLBACK, DECLINED = "profile", "planned", "fallback", "declined"


class HostStepTimer:
    """Wall-clock time between our hooks (the compute the profiled step did)."""

    def start(self) -> None:
        self.t = time.perf_counter()

    def stop(self) -> Any:
        return time.perf_counter() - self.t

    def resolve(self, mark: Any) -> float:
        return mark


class CudaStepTimer:
    """CUDA events on the compute stream: the device time between our hooks, read at iteration end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _event(self) -> Any:
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(self.device))
        return e

    def start(self) -> None:
        self.begin = self._event()

    def stop(self) -> Any:
        return (self.begin, self._event())

    def resolve(self, mark: Any) -> float:
        begin, end = mark
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


class Counters:
    def __init__(self) -> None:
        self.iterations = 0
        self.swapped_out_bytes = 0
        self.swapped_in_bytes = 0
        self.demand_fetches = 0
        self.stall_seconds = 0.0
        self.replans = 0
        self.evictions = 0


class Executor:
    def __init__(
        self,
        device: torch.device,
        engine: Any,
        pool: HostPool,
        memory: DeviceMemory,
        planner: Callable[[Sequence], Optional[Schedule]],
        budget: int,
        profile_iterations: int = 2,
    ) -> None:
        self.device = device
        self.engine = engine
        self.pool = pool
        self.memory = memory
        self.planner = planner  # sequence -> schedule, or None to decline
        self.budget = budget
        self.timer: Any = CudaStepTimer(device) if device.type == "cuda" else HostStepTimer()
        self.profiles_left = profile_iterations
        self._previous: Optional[Sequence] = None  # the last profiling iteration's recording
        self.lock = threading.RLock()
        self.counters = Counters()
        self.mode = PROFILE
        self.schedule: Optional[Schedule] = None
        self.sequence: Optional[Sequence] = None
        self.closed = False
        self.iteration = 0
        self.actions: list[tuple[int, str, int]] = []  # what this iteration issued, in order
        self.last_actions: list[tuple[int, str, int]] = []  # ... and the last completed iteration's
        self._new_iteration_pending = True
        self._reset_iteration()

    # -- iteration lifecycle ----------------------------------------------------------------------------
    def _reset_iteration(self) -> None:
        self.step = 0
        self.vars: list[Variable] = []
        self.by_storage: dict[int, Variable] = {}
        self.inflight: list[Variable] = []  # conservative plan: leave the device at the next step
        self.backward_started = False
        self.actions = []
        self.rec_var: list[int] = []
        self.rec_kind: list[str] = []
        self.rec_nonswap: list[int] = []
        self.rec_compute: list[float] = []
        self._resident_now = 0
        self.timer.start()
        self._next_access: list[int] = self.sequence.next_access() if self.sequence is not None else []

    def _maybe_start_iteration(self) -> None:
        if not self._new_iteration_pending:
            return
        self._new_iteration_pending = False
        self.iteration += 1
        self._reset_iteration()
        if self.mode == PROFILE:
            self.memory.window_peak()  # start the first step's window here

    def end_iteration(self) -> None:
        """Autograd finished a backward pass (engine callback)."""
        with self.lock:
            if self._new_iteration_pending:
                return
            self._record_interval()
            for v in self.inflight:
                self._release(v)
            self.inflight = []
            self.counters.iterations += 1
            self.last_actions = self.actions
            self._new_iteration_pending = True
            if self.mode == PROFILE:
                self._finish_profile()
            elif self.mode == FALLBACK:
                self.mode, self._previous, self.profiles_left = PROFILE, None, 1
            elif self.mode == PLANNED and self.memory.window_peak() > self.budget:
                log.warning(
                    "swap: this iteration's peak exceeded the budget of %d bytes (planned %d): re-profiling",
                    self.budget, self.schedule.peak,
                )  # fmt: skip
                self.counters.replans += 1
                self.mode, self._previous, self.profiles_left = PROFILE, None, 1
            else:
                self.memory.window_peak()
            self.engine.measure()

    def _finish_profile(self) -> None:
        swappable = [True] * len(self.vars)
        for v in self.vars:
            # Still alive although we dropped our copy: someone else holds it, swapping it frees nothing.
            if v.storage_ref() is not None:
                swappable[v.id] = False
        compute = [self.timer.resolve(mark) for mark in self.rec_compute]
        seq = Sequence(self.rec_var, self.rec_kind, [v.nbytes for v in self.vars], self.rec_nonswap, compute, swappable)
        previous, self._previous = self._previous, seq
        if previous is not None and previous.signature() == seq.signature():
            seq.nonswap = [max(a, b) for a, b in zip(previous.nonswap, seq.nonswap)]
            seq.swappable = [a and b for a, b in zip(previous.swappable, seq.swappable)]
        self.profiles_left -= 1
        if self.profiles_left > 0:
            return  # profile once more (Note [Two profiling iterations])
        try:
            schedule = self.planner(seq)
        except InfeasibleBudget:
            self.mode, self.profiles_left = PROFILE, 1  # profile again next time (a later one may differ)
            raise
        self.sequence = seq
        self.schedule = schedule
        self.mode = PLANNED if schedule is not None else DECLINED

    # -- hooks ------------------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        with self.lock:
            if self.mode == DECLINED or self.closed:
                return t
            self._maybe_start_iteration()
            storage = t.untyped_storage()
            var = self.by_storage.get(storage.data_ptr())
            if var is None or var.storage_ref() is not storage:
                var = Variable(len(self.vars), storage, self.device, self.iteration)
                self.vars.append(var)
                self.by_storage[storage.data_ptr()] = var
            var.note_version(t)
            packed = Packed(var, t)
            self._step(var, SAVE, storage)
            return packed

    def unpack(self, p: Any) -> torch.Tensor:
        if not isinstance(p, Packed):
            return p
        with self.lock:
            var = p.var
            if self.closed or var.iteration != self.iteration or self._new_iteration_pending:
                return p.view_on(self._fetch_now(var))  # outside the plan (retain_graph, after exit)
            if not self.backward_started:
                self.backward_started = True
                torch.autograd.Variable._execution_engine.queue_callback(self.end_iteration)
            self._step(var, USE, None)
            out = p.view_on(var.dev)
            if self.mode == PLANNED and self._next_access[self.step - 1] >= len(self._next_access):
                var.dev = None  # its last use: autograd holds the view until the node is done
            return out

    # -- steps ------------------------------------------------------------------------------------------
    def _step(self, var: Variable, kind: str, storage: Optional[torch.UntypedStorage]) -> None:
        i = self.step
        self.step += 1
        var.last_access = i
        if self.mode == PLANNED and not self._matches(var, kind, i):
            self._diverged(var, kind, i)
        if self.mode == PLANNED:
            self._planned_step(var, kind, storage, i)
        else:
            if self.mode == PROFILE:
                self._record_interval()
            self._conservative_step(var, kind, storage, i)
            if self.mode == PROFILE:
                self.rec_var.append(var.id)
                self.rec_kind.append(kind)
                self._resident_now = sum(v.nbytes for v in self.vars if v.dev is not None)
                self.timer.start()

    def _matches(self, var: Variable, kind: str, i: int) -> bool:
        seq = self.sequence
        return i < len(seq) and seq.var[i] == var.id and seq.kind[i] == kind and seq.sizes[var.id] == var.nbytes

    def _diverged(self, var: Variable, kind: str, i: int) -> None:
        seq = self.sequence
        expected = f"{seq.kind[i]} of {seq.sizes[seq.var[i]]} bytes" if i < len(seq) else "the end of the iteration"
        log.info("swap: step %d is a %s of %d bytes, the plan expected %s: re-profiling", i, kind, var.nbytes, expected)
        self.counters.replans += 1
        self.mode = FALLBACK
        for v in self.vars:
            if v is not var and v.dev is not None and v.host is not None:
                self.inflight.append(v)

    def _record_interval(self) -> None:
        """Closes the step that just ended: its peak less our resident variables, and its compute time."""
        if self.step == 0 and not self.rec_var:
            return
        if len(self.rec_nonswap) < len(self.rec_var):
            self.rec_nonswap.append(max(0, self.memory.window_peak() - self._resident_now))
            self.rec_compute.append(self.timer.stop())

    def _conservative_step(self, var: Variable, kind: str, storage: Optional[torch.UntypedStorage], i: int) -> None:
        for v in self.inflight:
            if v is not var:
                self._release(v)
        self.inflight = []
        if kind == SAVE:
            if var.dev is None:
                var.attach(storage)
            self._log(i, "access", var)
            self._swap_out(var, i)
        else:
            self._ensure_resident(var, i)
            self._log(i, "access", var)
            guess = self.vars[var.id - 1] if var.id > 0 else None
            if guess is not None and guess.dev is None and guess.host is not None:
                self._swap_in(guess, i)
        self.inflight.append(var)

    def _planned_step(self, var: Variable, kind: str, storage: Optional[torch.UntypedStorage], i: int) -> None:
        s = self.schedule
        for u in s.release[i]:
            self._release(self.vars[u], i)
        for u in s.swap_in[i]:
            self._swap_in(self.vars[u], i)
        if kind == SAVE:
            if var.dev is None:
                var.attach(storage)
        else:
            self._ensure_resident(var, i)
        self._log(i, "access", var)
        for u in s.swap_out[i]:
            self._swap_out(self.vars[u], i)

    # -- moving bytes -----------------------------------------------------------------------------------
    def _log(self, i: int, action: str, var: Variable) -> None:
        self.actions.append((i, action, var.id))

    def _swap_out(self, var: Variable, i: int) -> None:
        if var.host is None:
            var.set_host(self.pool.alloc(var.nbytes), self.pool.free)
            var.d2h = self.engine.d2h(var.host.view, var.dev)
            self.counters.swapped_out_bytes += var.nbytes
        self._log(i, "swap_out", var)

    def _release(self, var: Variable, i: Optional[int] = None) -> None:
        if var.dev is None:
            return
        if var.host is None:
            var.dev = None  # never swapped: dying (its last access passed)
            return
        if var.d2h is not None:
            self.counters.stall_seconds += self.engine.wait_host(var.d2h)
            var.d2h = None
            var.check_versions()
        if var.h2d is not None:  # fetched but not used: the copy must finish before the memory goes
            self.counters.stall_seconds += self.engine.wait_host(var.h2d)
            var.h2d = None
        var.dev = None
        if i is not None:
            self._log(i, "release", var)

    def _swap_in(self, var: Variable, i: int) -> None:
        if var.dev is not None or var.host is None:
            return
        if var.d2h is not None:  # released without a wait (evicted): its copy must be complete
            self.counters.stall_seconds += self.engine.wait_host(var.d2h)
            var.d2h = None
        dev = torch.empty(var.nbytes, dtype=torch.uint8, device=self.device)
        var.h2d = self.engine.h2d(dev, var.host.view)
        var.dev = dev
        self.counters.swapped_in_bytes += var.nbytes
        self._log(i, "swap_in", var)

    def _ensure_resident(self, var: Variable, i: int) -> None:
        if var.dev is None:
            self.counters.demand_fetches += 1
            self._log(i, "demand", var)
            self._swap_in(var, i)
        if var.h2d is not None:
            self.counters.stall_seconds += self.engine.wait_compute(var.h2d)
            var.h2d = None

    def _fetch_now(self, var: Variable) -> torch.Tensor:
        """A synchronous copy back, for unpacks outside the plan."""
        if var.dev is not None:
            if var.h2d is not None and not self.closed:
                self.engine.wait_compute(var.h2d)
            return var.dev
        if var.d2h is not None and not self.closed:
            self.engine.wait_host(var.d2h)
        return var.host.view.to(self.device, copy=True)

    # -- the allocator's OOM handler --------------------------------------------------------------------
    def evict(self, nbytes: int) -> bool:
        """Frees device copies of resident variables, least recently used first (copying those that have no
        host copy yet, synchronously), until ``nbytes`` are freed. True if anything was evicted."""
        with self.lock:
            if self.closed:
                return False
            current = self.step - 1
            victims = sorted(
                (v for v in self.vars if v.dev is not None and v.last_access < current and v.h2d is None),
                key=lambda v: v.last_access,
            )
            freed = 0
            for v in victims:
                if freed >= nbytes:
                    break
                if v.host is None:
                    v.set_host(self.pool.alloc(v.nbytes), self.pool.free)
                    v.d2h = self.engine.d2h(v.host.view, v.dev)
                    self.counters.swapped_out_bytes += v.nbytes
                self._release(v)
                freed += v.nbytes
                self.counters.evictions += 1
            return freed > 0

    def close(self) -> None:
        with self.lock:
            for v in self.inflight:
                try:
                    self._release(v)
                except RuntimeError:
                    pass
            self.inflight = []
            self.closed = True
            # Our references go; autograd's handles keep what a late unpack may still need.
            self.vars, self.by_storage = [], {}


__all__ = ["Executor", "PROFILE", "PLANNED", "FALLBACK", "DECLINED"]
