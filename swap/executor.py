"""The executor: runs inside the saved-tensor hooks and moves variables as the schedule says.

Each pack and unpack is one step. In a *planned* iteration, step i issues ``release[i]`` (wait for the D2H
copy, drop the device copy), ``swap_in[i]`` (start H2D), the access (a use waits for its H2D copy, or
fetches on demand if the plan missed: slower, never wrong), then ``swap_out[i]`` (start D2H). A *profiling*
iteration runs the conservative plan instead and records the sequence the scheduler plans with
(swap.recorder).

Note [Budget-aware profiling]
The conservative plan holds as little as any plan can: a variable's copy to host starts when it is saved,
and its device copy is dropped at the next step; a use fetches its variable, or re-attaches the forward's
storage when someone still holds it (a second copy would only add memory). So a profiling step needs no
more than its floor (swap.budget.step_floors). The one optional extra is a prefetch: the second profiling
iteration fetches the next use of the first one ahead of time, and only when what is live, the variable,
and what the step allocated last time fit the budget. The first iteration fetches on demand. Whatever
our own copies, everything is released when a backward pass ends, so nothing of ours is held across the
optimizer step.

Note [Two profiling iterations]
The first iteration is not representative: gradients and optimizer state (momentum, Adam moments) are made
during it, so the memory that is not ours to move is larger in every later iteration. The executor
therefore profiles two iterations, both with the conservative plan, and plans from the element-wise larger
of the two. If the first alone cannot fit the budget, no later one can: ``InfeasibleBudget`` is raised at
once (at the second iteration's first saved tensor), with ``min_budget`` raised by what the optimizer step
added. After the sequence changes, one profiling iteration suffices.

Note [Iteration boundaries]
An iteration starts at the first saved tensor after a backward pass has ended (autograd's engine callback,
queued at the first unpack of each backward). So a second backward over a retained graph, several
forwards before one backward, or a forward whose graph is dropped all belong to the iteration they run in,
and the optimizer step is part of the last step's interval. Variables are numbered afresh in save order
each iteration, so a repeated training step reproduces the profiled sequence step for step; the first step
that differs (shape, order) switches the rest of the iteration to the conservative plan and makes the next
one a profiling iteration.

Note [Step windows]
A step's measured peak is the highest memory from its access to the next one. The window is restarted after
the access's releases, not before them: the memory they free belonged to the step before (it was counted
there), and counting it again would inflate the step, its plan, and ``min_budget``.

Note [Host block reuse]
Every iteration saves variables of the same sizes again. A dead variable's host block is kept by size and
handed to the next variable of that size, so the steady state never searches the host pool's free lists.

Note [Learning from an overrun]
Planned iterations measure every step. A step that exceeds the budget is warned about at once
(``BudgetWarning``), and at the next iteration's start the plan is remade with the measured memory for
that step: once per step (a step that keeps varying is not re-planned again: no cycle). When the memory
live at an iteration's start grows past what the plan assumed (optimizer state made later, a larger
input), the plan is remade with that growth, before any step can exceed the budget.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from .budget import fmt_bytes
from .host_pool import HostPool
from .memory import DeviceMemory
from .recorder import Recorder
from .scheduler import InfeasibleBudget, Schedule
from .sequence import SAVE, USE, Sequence
from .tracer import ModulePaths, Packed, Variable, passthrough

log = logging.getLogger("swap")

PROFILE, PLANNED, FALLBACK, DECLINED = "profile", "planned", "fallback", "declined"


_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)  # the backward node running now
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def _backward_running() -> bool:
    """Whether this thread is running a backward pass (autograd's engine has a graph task for it).

    Note [Unpacks outside backward]
    A saved tensor can be read outside backward: ``grad_fn._saved_self`` after a forward (torchviz's
    ``show_saved``, a debugger, a test). That is no step of the iteration, and no end of backward can be
    queued for it (autograd accepts final callbacks only while a backward runs on the thread, and raises
    otherwise). Such an unpack is served like one from an old graph (``_fetch_outside``: the forward's
    storage if it is still alive, else a copy the caller alone holds) and leaves the iteration's plan and
    its boundaries alone."""
    return _graph_task_id is None or _graph_task_id() != -1


class WholeModelCompiled(RuntimeError):
    """Saved tensors come from a torch.compile'd region that is the whole model (or the whole step).

    Note [Hooks and torch.compile]
    A compiled region is one autograd Function: autograd saves what it keeps for backward when its forward
    returns, and its backward takes all of it at once. Swapping acts at region boundaries, so it works for
    regional compile (each block compiled: torch.compile(block), or Module.compile on a user-defined
    block), and can do nothing when the region is the whole model. The hooks themselves are excluded from
    tracing (torch._dynamo.disable): dynamo would otherwise try to trace them into the region, and break
    the graph at each saved tensor.

    What counts as the whole model (profiling, from the stack: ModulePaths):
    - a region that is the outermost module's forward (torch.compile(model), model.compile()): refused at
      its first saved tensor;
    - a region outside any module (a compiled function) is the whole model only if the model's forward is
      in it, i.e. a compiled training step: then no tensor of the iteration was saved inside a module. That
      is known once the forward is over, so it is refused at the backward's first unpack. A compiled loss
      or any other small compiled function next to an eager (or regionally compiled) model is swapped as
      usual."""

    def __init__(self) -> None:
        super().__init__(
            "swap: the model is compiled as a whole (torch.compile(model), or a compiled training step): autograd "
            "saves every activation at once when the compiled forward returns, and the compiled backward takes "
            "them all at once, so swapping cannot lower any peak. Use regional compile instead: compile each "
            "block (model.layers[i] = torch.compile(model.layers[i]), or block.compile() for your own block "
            "classes), so the saved tensors are swapped at block boundaries; or use the compiler's own activation "
            "offloading instead of swap.SwapManager."
        )


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
        self.overruns = 0  # steps measured above the budget


@dataclass
class Profiled:
    """What a finished profiling iteration hands to the manager's planner."""

    sequence: Optional[Sequence]  # None: nothing was saved that the manager may move
    final: bool  # the last profiling iteration: plan now (else only judge feasibility)
    growth: int  # memory live at this iteration's start less at the profiled one's
    unswapped_peak: Optional[int]  # what the run reaches without swapping, where it can be measured
    peak: int  # the highest memory the iteration measured
    overruns: list[tuple[int, int]] = field(default_factory=list)  # (step, measured) above the budget


class Executor:
    def __init__(
        self,
        device: torch.device,
        engine: Any,
        pool: HostPool,
        memory: DeviceMemory,
        planner: Callable[[Profiled], Optional[Schedule]],
        budget: int,
        profile_iterations: int = 2,
        *,
        replanner: Optional[Callable[[Sequence], Schedule]] = None,
        warn: Optional[Callable[[Any, str], None]] = None,
    ) -> None:
        self.device = device
        self.engine = engine
        self.pool = pool
        self.memory = memory
        self.planner = planner  # judges a profile; returns the schedule, or None to decline (or to go on)
        self.replanner = replanner or (lambda seq: planner(Profiled(seq, True, 0, None, 0)))
        self.warn = warn or (lambda cause, message: log.warning("swap: %s", message))
        self.budget = budget
        self.timer: Any = CudaStepTimer(device) if device.type == "cuda" else HostStepTimer()
        self.profiles_left = profile_iterations
        self.lock = threading.RLock()
        # Byte counts changed by callbacks; never held while waiting. Re-entrant: a weakref/GC callback (a
        # storage dying) can run on this thread while it is held, and takes it again.
        self._acct = threading.RLock()
        self.counters = Counters()
        self.mode = PROFILE
        self.schedule: Optional[Schedule] = None
        self.sequence: Optional[Sequence] = None
        self.closed = False
        self.iteration = 0
        self.modules = ModulePaths()
        self.allow_decline = True
        self._previous: Optional[Sequence] = None  # the last profiling iteration's recording
        self._unswapped_peak: Optional[int] = None
        self._plan_first_live = 0
        self._learned: set[int] = set()
        self._to_learn: dict[int, int] = {}  # step -> measured nonswap, in this planned iteration
        self._dying: list[Variable] = []  # dead variables whose copies were still in flight
        self._spare_host: dict[int, list[Any]] = {}  # bytes -> host blocks of dead variables, for reuse
        self._kept: dict[int, Any] = {}  # profiling: saved tensors kept on the device (min_bytes, exclude)
        self._kept_bytes = 0
        self._backward_done = True  # so the first saved tensor starts iteration 1
        self._in_backward = False
        self._iteration_counted = True
        self._in_hook = False
        self._last_node: Any = None
        self._node_groups = 0
        self.actions: list[tuple[int, str, int]] = []  # what this iteration issued, in order
        self.last_actions: list[tuple[int, str, int]] = []  # ... and the last completed iteration's
        self.recorder: Optional[Recorder] = None
        self._reset_iteration()

    # -- iteration lifecycle ----------------------------------------------------------------------------
    def _reset_iteration(self) -> None:
        self.step = 0
        self.vars: list[Variable] = []
        self.by_storage: dict[int, Variable] = {}
        self.held_vars: list[Variable] = []  # conservative plan: ours until the next step
        self.prefetched: Optional[Variable] = None
        self._on_device_bytes = 0
        self.actions = []
        self._matching = True  # profiling: so far this iteration repeats the previous profile
        # Profiling: saves inside some module / inside a compiled function outside any module (Note [Hooks
        # and torch.compile]).
        self._saved_in_module = self._saved_in_compiled_function = False

    def _begin_iteration(self, t: torch.Tensor) -> None:
        """The first saved tensor after a backward: judge the iteration that ended, start the next."""
        peak = self.memory.window_peak()
        shadow = self.memory.shadow_window_peak()
        if self.iteration > 0 and self.step > 0:
            self._close_step(peak, tail=True)
        self._release_leftovers()
        old_vars, recorder, ended = self.vars, self.recorder, self.mode
        steps = self.step
        self.last_actions = self.actions
        self._backward_done, self._iteration_counted = False, False
        self.iteration += 1
        self.recorder = None
        first_live = self.memory.current()
        self._reset_iteration()
        if ended == PROFILE and recorder is not None:
            self._finish_profile(recorder, old_vars, shadow, first_live, peak)
        elif ended == PLANNED:
            self._after_planned(first_live, steps)
        elif ended == FALLBACK:
            self.mode, self.profiles_left, self._previous = PROFILE, 1, None
        if self.mode == PROFILE:
            self.recorder = Recorder(first_live, t.untyped_storage().nbytes())

    def _finish_profile(
        self, rec: Recorder, old_vars: list[Variable], shadow: Optional[int], first_live: int, peak: int
    ) -> None:
        seq = rec.finish([v.nbytes for v in old_vars], [v.module for v in old_vars], self.timer.resolve)
        if seq is not None and self._previous is not None and self._previous.signature() == seq.signature():
            seq = _merge(self._previous, seq)
        self._previous = seq
        if shadow is not None:
            self._unswapped_peak = max(self._unswapped_peak or 0, shadow)
        self.profiles_left -= 1
        final = self.profiles_left <= 0
        growth = max(0, first_live - rec.first_live)
        peak = max([peak] + rec.peak)
        try:
            schedule = self.planner(Profiled(seq, final, growth, self._unswapped_peak, peak, rec.overruns))
        except InfeasibleBudget:
            self.mode, self.profiles_left, self._previous = PROFILE, 1, None
            raise
        if final:
            self.sequence, self.schedule = seq, schedule
            self.mode = PLANNED if schedule is not None else DECLINED
            if seq is None:
                self.allow_decline = False  # nothing to manage (the manager warned): nothing to re-profile for
            self._plan_first_live = rec.first_live
            self._learned, self._to_learn = set(), {}
            if self.mode == PLANNED:
                self._grown(first_live)

    def _after_planned(self, first_live: int, steps: int) -> None:
        seq = self.sequence
        if steps != len(seq):  # ended early: the sequence changed
            log.info("swap: the iteration ended after %d steps, the plan has %d: re-profiling", steps, len(seq))
            self.counters.replans += 1
            self.mode, self.profiles_left, self._previous = PROFILE, 1, None
            return
        new = {i: b for i, b in self._to_learn.items() if i not in self._learned}
        self._to_learn = {}
        if new:
            nonswap = list(seq.nonswap)
            for i, b in new.items():
                nonswap[i] = max(nonswap[i], b)
            self._learned |= set(new)
            self._replan(replace(seq, nonswap=nonswap), f"{len(new)} step(s) measured above the plan")
        self._grown(first_live)

    def _grown(self, first_live: int) -> None:
        """The memory live at the iteration's start grew past what the plan assumed: plan with it."""
        growth = first_live - self._plan_first_live
        if growth > 0 and self.schedule.peak + growth > self.budget:
            self._plan_first_live = first_live
            seq = self.sequence
            why = f"{fmt_bytes(growth)} more was live at the iteration's start than when it was profiled"
            self._replan(replace(seq, nonswap=[b + growth for b in seq.nonswap]), why)

    def _replan(self, seq: Sequence, why: str) -> None:
        self.counters.replans += 1
        log.info("swap: re-planning: %s", why)
        try:
            self.schedule = self.replanner(seq)
        except InfeasibleBudget:
            self.mode, self.profiles_left, self._previous = PROFILE, 1, None
            raise
        self.sequence = seq

    def _backward_end(self) -> None:
        """Autograd finished a backward pass (engine callback)."""
        with self.lock:
            self._in_backward = False
            self._backward_done = True
            self._last_node = None  # the node (and the graph behind it) must not outlive the backward
            if not self._iteration_counted:
                self.counters.iterations += 1
                self._iteration_counted = True
            if self.closed:
                return
            self._process_dying()
            if self.mode in (PROFILE, FALLBACK):
                for v in self.held_vars:  # nothing of ours is held across the optimizer step
                    self._release(v)
                self.held_vars, self.prefetched = [], None
            elif self.mode == DECLINED:
                peak = self.memory.window_peak()
                if peak > self.budget and self.allow_decline and self.sequence is not None:
                    self.warn(
                        "declined-overrun",
                        f"the run was not swapped (it fit the budget when profiled), but this iteration reached "
                        f"{fmt_bytes(peak)}, over the budget of {fmt_bytes(self.budget)}: profiling again and "
                        "swapping from now on",
                    )
                    self.counters.overruns += 1
                    self.allow_decline = False
                    self.mode, self.profiles_left, self._previous = PROFILE, 1, None
            self.engine.measure()

    def _release_leftovers(self) -> None:
        """Variables of the iteration that ended and still on the device leave it (graphs kept alive)."""
        self._process_dying()
        for v in self.vars:
            if v.dev is not None:
                self._release(v)
        self.held_vars, self.prefetched = [], None

    # -- hooks ------------------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        with self.lock:
            if self.closed:
                return passthrough(t)
            if self.mode == DECLINED:
                if self._backward_done and not self._in_backward:
                    self._backward_done, self._iteration_counted = False, False
                return passthrough(t)
            if self._backward_done and not self._in_backward:
                self._begin_iteration(t)
                if self.mode == DECLINED:
                    return passthrough(t)
            storage = t.untyped_storage()
            key = storage.data_ptr()
            var = self.by_storage.get(key)
            if var is None or not var.alive or var.storage_ref() is not storage:
                var = Variable(len(self.vars), storage, self.device, self.iteration, self)
                self.vars.append(var)
                self.by_storage[key] = var
                with self._acct:
                    self._on_device_bytes += var.nbytes
                if self.recorder is not None:
                    var.module = self.modules.current()
                    if not self.modules.in_module:
                        self._saved_in_compiled_function |= self.modules.compiled
                    elif self.modules.compiled and not var.module:
                        raise WholeModelCompiled()  # the outermost module's forward is compiled
                    else:
                        self._saved_in_module = True
            var.note_version(t)
            packed = Packed(var, t)
            self._step(var, SAVE, storage)
            return packed

    def observe(self, t: torch.Tensor) -> None:
        """A saved tensor the manager leaves alone: it still marks where iterations begin."""
        if self._backward_done and not self._in_backward and self.mode != DECLINED:
            with self.lock:
                if self._backward_done and not self._in_backward and not self.closed:
                    self._begin_iteration(t)

    def unpack(self, p: Any) -> torch.Tensor:
        if not isinstance(p, Packed):
            if not self._in_backward and _backward_running():
                with self.lock:
                    self._queue_end_of_backward()
            return p
        with self.lock:
            var = p.var
            if self.closed or var.iteration != self.iteration:
                return p.view_on(self._fetch_outside(var))  # outside the plan (an old graph, after exit)
            if not _backward_running():
                return p.view_on(self._fetch_outside(var))  # Note [Unpacks outside backward]
            if self._saved_in_compiled_function and not self._saved_in_module and self.recorder is not None:
                raise WholeModelCompiled()  # a compiled step: the model's forward ran inside the compiled function
            self._queue_end_of_backward()
            self._step(var, USE, None)
            return p.view_on(var.dev)

    def _queue_end_of_backward(self) -> None:
        if not self._in_backward:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
            self._in_backward = True  # only once the callback that clears it is queued

    def note_kept(self, t: torch.Tensor) -> None:
        """Profiling: a saved tensor stays on the device because of min_bytes or exclude (for diagnosis)."""
        if self.mode != PROFILE or self.closed:
            return
        st = t.untyped_storage()
        key = id(st)
        entry = self._kept.get(key)
        if entry is not None and entry[0]() is st:
            return
        n = st.nbytes()

        def gone(ref: Any, key: int = key, n: int = n) -> None:
            with self._acct:
                if self._kept.get(key, (None,))[0] is ref:
                    del self._kept[key]
                    self._kept_bytes -= n

        with self._acct:
            self._kept[key] = (weakref.ref(st, gone), n)
            self._kept_bytes += n

    # -- callbacks from variables (any thread; never wait, never take self.lock) --------------------------
    def _now(self) -> int:
        return self.step - 1 if self._in_hook else self.step

    def _set_on_device(self, var: Variable, flag: bool) -> None:
        with self._acct:
            if var.on_device == flag:
                return
            var.on_device = flag
            if not var.alive:
                return
            delta = var.nbytes if flag else -var.nbytes
            if var.iteration == self.iteration:
                self._on_device_bytes += delta
        self.memory.add_shadow(-delta)

    def original_died(self, var: Variable) -> None:
        rec = self.recorder
        if rec is not None and var.iteration == self.iteration:
            rec.held_until.setdefault(var.id, self._now())
            if not self._in_hook and var.alive and var.dev is None:
                rec.held_freed(var.nbytes)
                self.memory.add_held(var.nbytes)
        if var.copy_ref is None or var.copy_ref() is None:
            self._set_on_device(var, False)

    def copy_died(self, var: Variable, ref: Any) -> None:
        if ref is not var.copy_ref:
            return
        var.copy_ref = None
        if var.original() is None:
            self._set_on_device(var, False)

    def var_dead(self, var: Variable) -> None:
        """Autograd released every handle of ``var``: its memory goes (now, or once its copies are done)."""
        if not var.alive:
            return
        if self.recorder is not None and var.iteration == self.iteration:
            self.recorder.freed[var.id] = self._now()
        with self._acct:
            if var.on_device and var.iteration == self.iteration:
                self._on_device_bytes -= var.nbytes
            var.alive = False
        if not var.on_device:
            self.memory.add_shadow(-var.nbytes)  # a run without swapping frees it now
        if var.d2h is not None and self.engine.done(var.d2h):
            var.d2h = None  # long done (kept resident since): no wait
        if var.d2h is not None or var.h2d is not None:
            self._dying.append(var)  # a copy still reads or writes its memory: released at the next step
        else:
            var.dev = None
            self._recycle_host(var)

    def _process_dying(self) -> None:
        while self._dying:
            var = self._dying.pop()
            for ticket in (var.d2h, var.h2d):
                if ticket is not None and not self.closed:
                    self.engine.wait_host(ticket)
            var.d2h = var.h2d = None
            var.dev = None
            self._recycle_host(var)

    # -- steps ------------------------------------------------------------------------------------------
    def _step(self, var: Variable, kind: str, storage: Optional[torch.UntypedStorage]) -> None:
        i = self.step
        self.step += 1
        self._in_hook = True
        try:
            var.last_access = i
            if self._dying:
                self._process_dying()
            if i > 0:
                self._close_step(self.memory.window_peak())
            if self.mode == PLANNED and not self._matches(var, kind, i):
                self._diverged(var, kind, i)
            if self.mode == PLANNED:
                self._planned_step(var, kind, storage, i)
            else:
                self._conservative_step(var, kind, storage, i)
            rec = self.recorder
            if rec is not None:
                if self._matching and self._previous is not None:
                    prev = self._previous
                    self._matching = i < len(prev) and prev.var[i] == var.id and prev.kind[i] == kind
                rec.open_step(var.id, kind, self._on_device_bytes, self.memory.current(), self._kept_bytes,
                              self._node_group(kind))  # fmt: skip
                self.timer.start()
        finally:
            self._in_hook = False

    def _node_group(self, kind: str) -> int:
        """Profiling: consecutive uses by one backward node share a group (the node holds what it unpacked)."""
        node = _current_node() if kind == USE else None
        if node is None:
            self._last_node = None
            return -1
        if node is not self._last_node:
            self._last_node = node  # kept alive, so the next node cannot reuse its id
            self._node_groups += 1
        return self._node_groups

    def _close_step(self, peak: int, tail: bool = False) -> None:
        """The interval after the previous access ended with ``peak`` the highest memory in it (``tail``: the
        iteration's last interval, through the optimizer step)."""
        i = self.step - 2 if self._in_hook else self.step - 1  # the step whose interval this was
        rec = self.recorder
        if rec is not None:
            rec.close_step(peak, self.memory.held_window_peak(), self.timer.stop())
        if peak <= self.budget:
            return
        self.counters.overruns += 1
        if rec is not None:
            rec.overruns.append((i, peak))
            self.warn(
                ("profile-overrun", self.iteration),
                f"profiling iteration {self.iteration} exceeded the budget of {fmt_bytes(self.budget)} by "
                f"{fmt_bytes(peak - self.budget)} ({fmt_bytes(peak)}) {self._where(i, tail, rec)}. A profiling "
                "iteration holds only the saved tensor each step uses, so what is not swappable there exceeds the "
                "budget (InfeasibleBudget follows at the next iteration's first saved tensor, with the smallest "
                "budget that fits) or grew since the last profile",
            )
        elif self.mode == PLANNED and i < len(self.sequence):
            seq, s = self.sequence, self.schedule
            planned = seq.nonswap[i] + s.resident[i]
            self._to_learn[i] = max(self._to_learn.get(i, 0), peak - s.resident[i])
            again = i in self._learned
            self.warn(
                ("planned-overrun-again" if again else ("planned-overrun", self.iteration)),
                f"iteration {self.iteration} exceeded the budget of {fmt_bytes(self.budget)} by "
                f"{fmt_bytes(peak - self.budget)} {self._where(i, tail)} (planned {fmt_bytes(planned)}, measured "
                f"{fmt_bytes(peak)}): "
                + ("it was re-planned for that already; the memory there varies between iterations"
                   if again else "the next iteration is planned with what was measured"),
            )  # fmt: skip

    def _where(self, i: int, tail: bool, rec: Optional[Recorder] = None) -> str:
        var_ids, kinds = (rec.var, rec.kind) if rec is not None else (self.sequence.var, self.sequence.kind)
        if i >= len(var_ids):
            return "after the last saved tensor"
        v = var_ids[i]
        module = self.vars[v].module if v < len(self.vars) else ""
        if not module and self.sequence is not None and self.sequence.modules and v < len(self.sequence.modules):
            module = self.sequence.modules[v]
        phase = "forward" if kinds[i] == SAVE else "backward"
        if tail:
            return f"after the backward of {module or 'the model'} (the rest of backward, the optimizer step)"
        return f"in the {phase} of {module or 'the model'}"

    def _matches(self, var: Variable, kind: str, i: int) -> bool:
        seq = self.sequence
        return i < len(seq) and seq.var[i] == var.id and seq.kind[i] == kind and seq.sizes[var.id] == var.nbytes

    def _diverged(self, var: Variable, kind: str, i: int) -> None:
        seq = self.sequence
        expected = f"{seq.kind[i]} of {seq.sizes[seq.var[i]]} bytes" if i < len(seq) else "the end of the iteration"
        log.info("swap: step %d is a %s of %d bytes, the plan expected %s: re-profiling", i, kind, var.nbytes, expected)
        self.counters.replans += 1
        self.mode = FALLBACK
        self.held_vars = [v for v in self.vars if v is not var and v.dev is not None and v.alive]

    def _conservative_step(self, var: Variable, kind: str, storage: Optional[torch.UntypedStorage], i: int) -> None:
        keep = []
        for v in self.held_vars:
            if v is var or v is self.prefetched:
                continue
            if v.host is None and v.alive and v.dev is not None:
                self._swap_out(v, None)  # no copy yet (left by a plan): it leaves at the next step
                keep.append(v)
            else:
                self._release(v)
        self.held_vars = keep
        self._restart_window()
        if kind == SAVE:
            if var.dev is None:
                var.attach(storage)
            self._log(i, "access", var)
            self._swap_out(var, i)
        else:
            self._ensure_resident(var, i)
            if self.prefetched is var:
                self.prefetched = None
            self._log(i, "access", var)
            self._prefetch_next(var, i)
        self.held_vars.append(var)

    def _prefetch_next(self, var: Variable, i: int) -> None:
        """Profiling: fetch the variable the previous profile used next, if it fits (Note [Budget-aware profiling])."""
        prev = self._previous
        if prev is None or not self._matching or self.prefetched is not None or self.mode != PROFILE:
            return
        nxt = next((j for j in range(i + 1, len(prev)) if prev.kind[j] == USE), None)
        if nxt is None or prev.var[nxt] >= len(self.vars):
            return
        u = self.vars[prev.var[nxt]]
        if u is var or u.dev is not None or u.host is None or not u.alive:
            return
        if self.memory.current() + u.nbytes + prev.transient[i] > self.budget:
            return
        self._swap_in(u, i)
        self.prefetched = u

    def _restart_window(self) -> None:
        """After a step's releases: the step's window starts from what is left (Note [Step windows])."""
        self.memory.window_peak()
        self.memory.held_window_peak()

    def _planned_step(self, var: Variable, kind: str, storage: Optional[torch.UntypedStorage], i: int) -> None:
        s = self.schedule
        for u in s.release[i]:
            self._release(self.vars[u], i)
        if s.release[i]:
            self._restart_window()
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

    def _recycle_host(self, var: Variable) -> None:
        """A dead variable's host block goes to the next iteration's variable of that size (Note [Host block
        reuse]); after close, to the pool."""
        if var.host is None:
            return
        if self.closed:
            var.free_host()
            return
        block = var.take_host()
        with self._acct:
            self._spare_host.setdefault(block.nbytes, []).append(block)

    def _host_block(self, nbytes: int) -> Any:
        with self._acct:
            spare = self._spare_host.get(nbytes)
            if spare:
                return spare.pop()
        return self.pool.alloc(nbytes)

    def _swap_out(self, var: Variable, i: Optional[int]) -> None:
        if var.host is None and var.dev is not None and var.alive:
            var.set_host(self._host_block(var.nbytes), self.pool.free)
            var.d2h = self.engine.d2h(var.host.view, var.dev)
            self.counters.swapped_out_bytes += var.nbytes
        if i is not None:
            self._log(i, "swap_out", var)

    def _release(self, var: Variable, i: Optional[int] = None) -> None:
        if var.dev is None:
            return
        if var.host is None and var.alive:
            self._swap_out(var, None)  # never dropped without a copy while autograd may still ask for it
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
        if var.dev is not None or not var.alive:
            return
        original = var.original()
        if original is not None and var.unchanged():
            var.attach(original)  # still alive elsewhere: a copy would only add memory
        elif var.host is not None:
            if var.d2h is not None:  # released without a wait (evicted): its copy must be complete
                self.counters.stall_seconds += self.engine.wait_host(var.d2h)
                var.d2h = None
            flat = self._new_copy(var)
            var.h2d = self.engine.h2d(flat, var.host.view)
            self.counters.swapped_in_bytes += var.nbytes
        else:
            raise RuntimeError(f"swap: internal error: variable {var.id} has neither a device nor a host copy")
        self._log(i, "swap_in", var)

    def _new_copy(self, var: Variable) -> torch.Tensor:
        """Device memory for ``var``'s bytes to come back into (a run without swapping would hold them)."""
        if not var.on_device:
            self.memory.add_shadow(-var.nbytes)
            with self._acct:
                var.on_device = True
                if var.alive and var.iteration == self.iteration:
                    self._on_device_bytes += var.nbytes
        flat = torch.empty(var.nbytes, dtype=torch.uint8, device=self.device)
        var.adopt_copy(flat)
        return flat

    def _ensure_resident(self, var: Variable, i: int) -> None:
        if var.dev is None:
            original = var.original()
            if original is None or not var.unchanged():
                self.counters.demand_fetches += 1
                self._log(i, "demand", var)
            self._swap_in(var, i)
        if var.h2d is not None:
            self.counters.stall_seconds += self.engine.wait_compute(var.h2d)
            var.h2d = None
        if not var.dev_is_copy and var.versions:
            var.check_versions("after it was saved, and the modified storage is what backward would read")

    def _fetch_outside(self, var: Variable) -> torch.Tensor:
        """A synchronous copy back, for unpacks outside the plan (a graph of an earlier iteration, after exit)."""
        if var.dev is not None:
            if var.h2d is not None and not self.closed:
                self.engine.wait_compute(var.h2d)
                var.h2d = None
            return var.dev
        original = var.original()
        if original is not None and var.unchanged():
            var.attach(original)
            flat, var.dev = var.dev, None  # not held: autograd's view keeps it for the node that asked
            return flat
        if var.d2h is not None and not self.closed:
            self.engine.wait_host(var.d2h)
            var.d2h = None
        if var.host is None:
            raise RuntimeError(f"swap: internal error: variable {var.id} has neither a device nor a host copy")
        if self.closed:
            return var.host.view.to(self.device, copy=True)
        flat = self._new_copy(var)
        flat.copy_(var.host.view)
        var.dev = None  # not held: autograd's view keeps it for the node that asked
        return flat

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
                self._release(v)
                freed += v.nbytes
                self.counters.evictions += 1
            return freed > 0

    def close(self) -> None:
        with self.lock:
            try:
                for v in self.held_vars:
                    try:
                        self._release(v)
                    except RuntimeError:
                        pass
                self._process_dying()
            finally:
                self.held_vars, self.prefetched, self._last_node = [], None, None
                self.closed = True
                for blocks in self._spare_host.values():
                    for block in blocks:
                        self.pool.free(block)
                self._spare_host = {}
                # Our references go; autograd's handles keep what a late unpack may still need.
                self.vars, self.by_storage = [], {}


def _merge(a: Sequence, b: Sequence) -> Sequence:
    """Two profiles of one sequence: the element-wise larger memory, swappable only where both say so."""
    return replace(
        b,
        nonswap=[max(x, y) for x, y in zip(a.nonswap, b.nonswap)],
        swappable=[x and y for x, y in zip(a.swappable, b.swappable)],
        held_until=[max(x, y) for x, y in zip(a.held_until, b.held_until)],
        node_last=[max(x, y) for x, y in zip(a.node_last, b.node_last)],
        freed=[max(x, y) for x, y in zip(a.freed, b.freed)],
        transient=[max(x, y) for x, y in zip(a.transient, b.transient)],
        kept=[max(x, y) for x, y in zip(a.kept, b.kept)],
        base=max(a.base, b.base),
        modules=[x or y for x, y in zip(a.modules, b.modules)],
    )


__all__ = ["Executor", "Profiled", "WholeModelCompiled", "PROFILE", "PLANNED", "FALLBACK", "DECLINED"]
