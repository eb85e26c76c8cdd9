"""The executor: runs inside the saved-tensor hooks and moves variables as the schedule says.

Each pack and unpack is one step. In a *planned* iteration, step i issues ``release[i]`` (wait for the D2H
copy, drop the device copy), ``swap_in[i]`` (start H2D), the access (a use waits for its H2D copy, or
fetches on demand if the plan missed: slower, never wrong), then ``swap_out[i]`` (start D2H). A *profiling*
iteration runs the conservative plan instead and records the sequence the scheduler plans with
(swap.runtime.recorder).

The executor is one object in three files: this one (the hooks, the steps, the callbacks from variables),
``lifecycle.py`` (iterations: profiling, planning, learning from what was measured) and ``transfers.py`` (the
copies, releases and evictions).

Note [Budget-aware profiling]
The conservative plan holds as little as any plan can: a variable's copy to host starts when it is saved,
and its device copy is dropped at the next step; a use fetches its variable, or re-attaches the forward's
storage when someone still holds it (a second copy would only add memory). So a profiling step needs no
more than its floor (swap.schedule.budget.step_floors). The one optional extra is a prefetch: the second
profiling iteration fetches the next use of the first one ahead of time, and only when what is live, the
variable, and what the step allocated last time fit the budget. The first iteration fetches on demand. Whatever
our own copies, everything is released when a backward pass ends, so nothing of ours is held across the
optimizer step.

Note [Step windows]
A step's measured peak is the highest memory from its access to the next one. The window is restarted after
the access's releases, not before them: the memory they free belonged to the step before (it was counted
there), and counting it again would inflate the step, its plan, and ``min_budget``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, Optional

import torch

from ..schedule.scheduler import Schedule
from ..schedule.sequence import SAVE, USE, Sequence
from .host_pool import HostPool
from .lifecycle import DECLINED, FALLBACK, PLANNED, PROFILE, Lifecycle, Profiled
from .memory import DeviceMemory
from .recorder import Recorder
from .timers import CudaStepTimer, HostStepTimer
from .tracer import ModulePaths, Packed, Variable, passthrough
from .transfers import Transfers

log = logging.getLogger("swap")

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


class Executor(Lifecycle, Transfers):
    """Follows a schedule from inside the saved-tensor hooks (the module docstring says how)."""

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
        unmanaged: Optional[Callable[[int], None]] = None,
    ) -> None:
        self.device = device
        self.engine = engine
        self.pool = pool
        self.memory = memory
        self.planner = planner  # judges a profile; returns the schedule, or None to decline (or to go on)
        self.replanner = replanner or (lambda seq: planner(Profiled(seq, True, 0, None, 0)))
        self.warn = warn or (lambda cause, message: log.warning("swap: %s", message))
        # Told an iteration's peak when it is over the budget and nothing is managed (Note [Nothing to move,
        # over the budget] in manager.py).
        self.unmanaged = unmanaged or (lambda peak: None)
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

    # -- hooks ------------------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        with self.lock:
            if self.closed:
                return passthrough(t)
            if self._in_backward and not _backward_running():
                self._backward_end()  # Note [A backward that raised]
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
        if self._in_backward and not _backward_running():
            self._backward_end()  # Note [A backward that raised]
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

    # Note [A backward that raised]
    # The end of a backward pass is autograd's final callback, queued at its first unpack. Autograd runs no
    # final callback when the pass raises (a gradient hook, an anomaly, an interrupt), so ``_in_backward``
    # would stay set: no later iteration would begin, and the manager would stop planning for the rest of the
    # run while training went on. So a saved tensor made while ``_in_backward`` is set and no backward runs
    # on this thread (a checkpointed region recomputed in backward is inside one) ends that backward first.
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
        rec = self.recorder
        if rec is not None and var.iteration == self.iteration:
            rec.copy_died(var.last_access, self._now())  # Note [A fetched copy held past its node]
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


__all__ = ["Executor", "Profiled", "WholeModelCompiled", "PROFILE", "PLANNED", "FALLBACK", "DECLINED"]
