"""The executor: runs inside the saved-tensor hooks and moves variables as the schedule says.

Each pack and unpack is one step. In a *planned* iteration, step i issues ``release[i]`` (wait for the D2H
copy, drop the device copy), ``swap_in[i]`` (start H2D), the access (a use waits for its H2D copy, or
fetches on demand if the plan missed: slower, never wrong), then ``swap_out[i]`` (start D2H). A *profiling*
iteration runs the conservative plan instead (swap.runtime.activations.conservative) and records the sequence the
scheduler plans with (swap.runtime.activations.recorder).

The executor finds where iterations begin and end (a saved tensor or a weight use after a backward, autograd's
final callback, a backward that raised); its ``steps`` (swap.runtime.activations.steps) take each step inside one.
It holds the other parts with one job each: its ``lifecycle`` (swap.runtime.activations.lifecycle: the plan and
its mode, learning from what was measured), its ``transfers`` (swap.runtime.activations.transfers: the copies and
releases) and its ``residency`` (swap.runtime.activations.residency: the variables' owner, counting which bytes
are on the device from callbacks on any thread).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional

import torch

from ...schedule.scheduler import Schedule
from ...schedule.sequence import SAVE, USE, Sequence
from ...units import fmt_bytes
from ..machine.host_pool import HostPool
from ..machine.memory import DeviceMemory
from ..machine.timers import CudaStepTimer, HostStepTimer
from .clean import CleanMover, CleanVariable
from .conservative import ConservativePlan
from .eviction import evict_lru
from .kept import KeptTensors
from .lifecycle import DECLINED, FALLBACK, PLANNED, PROFILE, Counters, Lifecycle, Planner, Profiled, Warn
from .plan_book import ShapeKey, shape_key
from .recorder import Recorder
from .residency import Residency
from .signals import WholeModelCompiled
from .steps import StepTaker
from .tracer import ModulePaths, Packed, Variable, backward_running, passthrough
from .transfers import Transfers

log = logging.getLogger("swap")


class Executor:
    """Follows a schedule from inside the saved-tensor hooks (the module docstring says how). ``planner``,
    ``replanner``, ``warn`` and ``unmanaged``: what its ``Lifecycle`` calls back."""

    def __init__(self, device: torch.device, engine: Any, pool: HostPool, memory: DeviceMemory, planner: Planner,
                 budget: int, profile_iterations: int = 2, *,
                 replanner: Optional[Callable[[Sequence], Schedule]] = None, warn: Optional[Warn] = None,
                 unmanaged: Optional[Callable[[int], None]] = None) -> None:  # fmt: skip
        self.device = device
        self.engine = engine
        self.pool = pool
        self.memory = memory
        self.budget = memory.budget = budget  # Note [What the over-budget count counts] (swap.runtime.machine.memory)
        self.timer: Any = CudaStepTimer(device) if device.type == "cuda" else HostStepTimer()
        self.lock = threading.RLock()
        # Byte counts changed by callbacks; never held while waiting. Re-entrant: a weakref/GC callback (a
        # storage dying) can run on this thread while it is held, and takes it again.
        self._acct = threading.RLock()
        self.counters = Counters()
        self.lifecycle = Lifecycle(
            budget, self.counters, planner,
            replanner or (lambda seq: planner(Profiled(seq, True, 0, None, 0))),
            warn or (lambda cause, message: log.warning("swap: %s", message)),
            unmanaged or (lambda peak: None),
            profile_iterations,
            lambda: device.type == "cuda" and torch.backends.cudnn.benchmark,  # Note [Benchmark trials are not ...]
        )  # fmt: skip
        # The variables' owner: their callbacks land there.
        self.steps = StepTaker(self)
        self.residency = Residency(self, memory, self._acct, lambda var: self.transfers.retire(var))
        self.transfers = Transfers(device, engine, pool, self.counters, self._acct, self.residency.copy_coming,
                                   self.steps.log)  # fmt: skip
        self.closed, self.iteration = False, 0
        # Note [The memory before the first iteration]: its peak, once the first iteration begins; ``entry_note``
        # says what the manager itself did there (the model-state runtime's wiring sets it)
        self.entry_peak: Optional[int] = None
        self.entry_note = ""
        self.modules = ModulePaths()
        self.kept = KeptTensors(self._acct)  # profiling: saved tensors kept on the device (min_bytes, exclude)
        self.clean: dict[int, CleanVariable] = {}  # bucket -> its variable (Note [Clean variables at run time])
        self.clean_mover: Optional[CleanMover] = None  # whose buckets are this iteration's first variables
        # Told before a use of clean weights begins an iteration (a saved tensor's beginning is told by the
        # saved-tensor hooks): the operator profiler cuts its iterations there (Note [Operator profiler]).
        self.on_boundary: Optional[Callable[[], None]] = None
        self._backward_done = True  # so the first saved tensor starts iteration 1
        self._in_backward = False
        self._iteration_counted = True
        self.last_actions: list[tuple[int, str, int]] = []  # ... and the last completed iteration's
        self.recorder: Optional[Recorder] = None
        self.conservative = ConservativePlan(self.transfers, memory, budget, self.steps.log)  # profiling's own plan
        self._reset_iteration()

    def _reset_iteration(self) -> None:
        self.saves = 0  # tensors saved this iteration, ours or not
        self.steps.reset()
        self.vars: list[Variable] = []
        self.by_storage: dict[int, Variable] = {}
        self.conservative.forget()
        self.residency.reset()
        # Profiling: saves inside some module / inside a compiled function outside any module (Note [Hooks
        # and torch.compile]).
        self._saved_in_module = self._saved_in_compiled_function = False

    # -- state others read ------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        """``PROFILE``, ``PLANNED``, ``FALLBACK`` or ``DECLINED`` (swap.runtime.activations.lifecycle)."""
        return self.lifecycle.mode

    @property
    def schedule(self) -> Optional[Schedule]:
        return self.lifecycle.schedule

    @property
    def sequence(self) -> Optional[Sequence]:
        """The sequence the schedule was planned on (None until planned)."""
        return self.lifecycle.sequence

    @property
    def in_backward(self) -> bool:
        """A backward pass is running (its end is queued with autograd)."""
        return self._in_backward

    @property
    def backward_done(self) -> bool:
        """A backward pass has ended and the next iteration has not begun (Note [Iteration boundaries])."""
        return self._backward_done

    @property
    def step(self) -> int:
        """The next step's index in this iteration."""
        return self.steps.i

    @property
    def in_hook(self) -> bool:
        """A step is being taken (callbacks that run inside it belong to the step before)."""
        return self.steps.in_hook

    @property
    def actions(self) -> list[tuple[int, str, int]]:
        """What this iteration issued, in order: (step, action, variable)."""
        return self.steps.actions

    def now(self) -> int:
        """The step whose interval it is now (for callbacks from variables)."""
        return self.steps.now()

    @property
    def between_iterations(self) -> bool:
        """The next saved tensor begins an iteration."""
        return self._backward_done and not self._in_backward

    # -- hooks ------------------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        with self.lock:
            if self.closed:
                return passthrough(t)
            if self._in_backward and not backward_running():
                self._backward_end()  # Note [A backward that raised]
            between = self._backward_done and not self._in_backward
            if self.lifecycle.mode == DECLINED and (not between or self._stays_declined(t)):
                return passthrough(t)
            if between:
                self._begin_iteration(self.memory.allocation_bytes(t.untyped_storage().nbytes()), shape_key(t))
                if self.lifecycle.mode == DECLINED:
                    return passthrough(t)
            storage, self.saves = t.untyped_storage(), self.saves + 1
            key = storage.data_ptr()
            var = self.by_storage.get(key)
            if var is None or not var.alive or var.storage_ref() is not storage:
                var = Variable(len(self.vars), storage, self.device, self.iteration, self.residency,
                               size=self.memory.allocation_bytes(storage.nbytes()))
                self.vars.append(var)
                self.by_storage[key] = var
                self.residency.saved(var)
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
            self.steps.take(var, SAVE, storage)
            return packed

    def observe(self, t: torch.Tensor) -> None:
        """A saved tensor the manager leaves alone: it still marks where iterations begin."""
        self._boundary(t)
        self.saves += 1

    def _boundary(self, t: torch.Tensor) -> None:
        """If ``t`` is the first saved tensor after a backward pass, the next iteration begins with it."""
        if self._in_backward and not backward_running():
            self._backward_end()  # Note [A backward that raised]
        if self._backward_done and not self._in_backward:
            with self.lock:
                if self._backward_done and not self._in_backward and not self.closed and not self._stays_declined(t):
                    self._begin_iteration(self.memory.allocation_bytes(t.untyped_storage().nbytes()), shape_key(t))

    def expects(self, t: torch.Tensor) -> bool:
        """Whether the plan being followed saves ``t``'s variable (a new one, or the one of its storage) here,
        where ``t``, under ``min_bytes``, is saved: the caller then packs it (Note [A plan's variables, whatever
        their size] in swap.runtime.activations.plan_book). ``t`` may begin the iteration: it is judged on that
        one's plan."""
        self._boundary(t)
        with self.lock:
            life, i = self.lifecycle, self.step
            seq = life.sequence
            if life.mode != PLANNED or self.closed or i >= len(seq) or not seq.saved_before:
                return False
            storage = t.untyped_storage()
            var = self.by_storage.get(storage.data_ptr())
            known = var is not None and var.alive and var.storage_ref() is storage  # saved before: that variable
            return (seq.kind[i] == SAVE and seq.var[i] == (var.id if known else len(self.vars))
                    and seq.saved_before[i] == self.saves + 1)  # fmt: skip

    def _stays_declined(self, t: Any) -> bool:
        """A declined run's iteration begins at ``t`` (a tensor, or an iteration's shape key): with the shape key
        of the last one, it only marks the boundary and stays declined; else its plan is chosen (Note [Plans by
        input shape])."""
        if not self.lifecycle.stays(shape_key(t) if isinstance(t, torch.Tensor) else t):
            return False
        self._backward_done, self._iteration_counted = False, False
        return True

    def use_clean(self, key: int, nbytes: int, mover: CleanMover, module: str) -> bool:
        """A use of bucket ``key`` of weights, a step like any access (Note [Clean variables at run time]); False
        when the executor takes no step for it (declined, closed, no grad: the caller moves the weights itself)."""
        with self.lock:
            running = backward_running()  # a forward without grad (evaluation) is no iteration's:
            if self.closed or self.steps.in_hook or not (running or torch.is_grad_enabled()):
                return False
            if self._in_backward and not running:
                self._backward_end()  # Note [A backward that raised]
            between, shape = not running and self.between_iterations, ("clean", (nbytes,))
            # Note [A declined run begins where a planned one does]
            # An iteration whose first access is a bucket's use begins there, under the bucket's shape key, in
            # every mode. A declined run used to leave the use to the streamer before looking for the boundary,
            # so its next iteration began at the first saved tensor instead, under the tensor's key: no plan was
            # kept under that key, so it profiled again, holding the bucket the streamer had fetched before the
            # boundary through the whole iteration, uncounted (the MLP of test_ms_min_budget at the smallest
            # budget its refusal named went over by its first layer's weights); and the plan made then was
            # kept under the tensor's key, so the run alternated between the two keys' plans, every other
            # iteration over the budget.
            if self.mode == DECLINED and (not between or self._stays_declined(shape)):
                return False
            if running:
                self._queue_end_of_backward()
            elif between:
                if self.on_boundary is not None:
                    self.on_boundary()
                self._begin_iteration(nbytes, shape)
            if self.lifecycle.mode == DECLINED:
                return False
            var = self.clean.get(key)
            if var is None or var.iteration != self.iteration:
                return False  # not one of this iteration's buckets (re-packed, or placed since it began)
            if self.recorder is not None and not var.module:
                var.module = module
            if not running:  # Note [Clean variables at run time]: its module's saves join the use's group
                self.steps.node_groups += 1
                self.steps.span = (self.steps.node_groups, var)
            self.steps.take(var, USE, None)
            return True

    def unpack(self, p: Any) -> torch.Tensor:
        if not isinstance(p, Packed):
            if not self._in_backward and backward_running():
                with self.lock:
                    self._queue_end_of_backward()
            return p
        with self.lock:
            var = p.var
            if self.closed or var.iteration != self.iteration:
                return p.view_on(self.transfers.fetch_outside(var))  # outside the plan (an old graph, after exit)
            if not backward_running():
                return p.view_on(self.transfers.fetch_outside(var))  # Note [Unpacks outside backward]
            if self._saved_in_compiled_function and not self._saved_in_module and self.recorder is not None:
                raise WholeModelCompiled()  # a compiled step: the model's forward ran inside the compiled function
            self._queue_end_of_backward()
            self.steps.take(var, USE, None)
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
        if self.lifecycle.mode == PROFILE and not self.closed:
            self.kept.note(t)

    def evict(self, nbytes: int) -> bool:
        """The allocator's OOM handler (swap.runtime.activations.eviction): True if anything was evicted. It
        frees what the request holds once served (two whole chunks for 2.25 MiB on vmalloc), not its own bytes."""
        return evict_lru(self, self.memory.allocation_bytes(nbytes))

    # -- iteration boundaries (Note [Iteration boundaries] in swap.runtime.activations.lifecycle) ---------------------
    def _begin_iteration(self, first_size: int, key: ShapeKey) -> None:
        """The first access after a backward (of ``first_size`` bytes, shape key ``key``): judge the iteration
        that ended, choose the next one's plan and start it."""
        peak, shadow = self.memory.window_peak(), self.memory.shadow_window_peak()
        if self.iteration == 0:
            self._judge_entry()
        if self.iteration > 0 and self.step > 0:
            self.steps.close(peak, tail=True)
        self._release_leftovers()
        self.transfers.new_iteration()
        life = self.lifecycle
        old_vars, rec, ended, steps = self.vars, self.recorder, life.mode, self.step
        self.last_actions = self.steps.actions
        self._backward_done, self._iteration_counted = False, False
        self.iteration += 1
        self.recorder = None
        first_live = self.memory.current()
        self._reset_iteration()
        if ended == PROFILE and rec is not None:
            seq = rec.finish([v.size for v in old_vars], [v.module for v in old_vars], self.timer.resolve,
                             [isinstance(v, CleanVariable) for v in old_vars])  # fmt: skip
            life.profiled(seq, rec.first_live, first_live, shadow, max([peak] + rec.peak), rec.overruns)
        elif ended == PLANNED:
            life.planned(first_live, steps, [v.size for v in old_vars])
        elif ended == FALLBACK:
            life.reprofile()
        life.enter(key, first_live)
        if life.mode == PROFILE:
            self.recorder = Recorder(first_live, first_size)
        if self.clean_mover is not None and life.mode != DECLINED:  # Note [Clean variables at run time]
            for var in self.clean_mover.variables(len(self.vars), self.iteration, self.residency):
                self.vars.append(var)
                self.clean[var.key] = var
                if self.recorder is not None:
                    self.recorder.held_until[var.id] = 0  # nothing but us holds it: releasing frees it at once

    # Note [The memory before the first iteration]
    # From the manager's entry to its first iteration's first access the device holds what the user brought in
    # (the model as built on the device, a batch) and, under model state, the weights while the runtime takes them
    # off (Note [The model as it enters] in swap.runtime.model_state.storage). No plan covers that stretch: the
    # plan holds the budget from the first iteration on. Its windows count in the report's peak and over-budget
    # count like any other (Note [What the over-budget count counts]); the report gives their peak as
    # ``entry_peak_bytes``, and a peak there above the budget is a BudgetWarning at the first iteration, so that it
    # is said out loud. On an H200 a 1B Llama built in fp32 (4.4 GB) entered a 4 GiB budget: the report's peak was
    # above the budget, its status "planned", and nothing warned, since only windows inside iterations were judged.
    def _judge_entry(self) -> None:
        """The first iteration begins: the memory before it is judged (Note [The memory before the first
        iteration])."""
        self.entry_peak = peak = self.memory.peak
        if peak <= self.budget:
            return
        what = self.entry_note or "what was alive on the device when the manager was entered"
        self.lifecycle.warn(
            "entry-over-budget",
            f"before its first training iteration the device held up to {fmt_bytes(peak)}, over the budget of "
            f"{fmt_bytes(self.budget)} by {fmt_bytes(peak - self.budget)}: {what}. The budget is planned and held "
            f"from the first iteration on; to hold it from the start, raise it to {fmt_bytes(peak)} or enter the "
            "manager with less on the device",
        )

    def _backward_end(self) -> None:
        """Autograd finished a backward pass (engine callback)."""
        with self.lock:
            self._in_backward = False
            self._backward_done = True
            self.steps.last_node = None  # the node (and the graph behind it) must not outlive the backward
            if not self._iteration_counted:
                self.counters.iterations += 1
                self._iteration_counted = True
            if self.closed:
                return
            self.transfers.process_dying()
            mode = self.lifecycle.mode
            if mode in (PROFILE, FALLBACK):
                self.conservative.release_all()  # nothing of ours is held across the optimizer step
            elif mode == DECLINED:
                self.lifecycle.declined_backward(self.memory.window_peak())
            self.engine.measure()

    def _release_leftovers(self) -> None:
        """Variables of the iteration that ended and still on the device leave it (graphs kept alive)."""
        self.transfers.process_dying()
        for v in self.vars:
            if v.dev is not None:
                self.transfers.release(v)
        self.conservative.forget()

    def close(self) -> None:
        with self.lock:
            try:
                for v in self.conservative.held:
                    try:
                        self.transfers.release(v)
                    except RuntimeError:
                        pass
                self.transfers.process_dying()
            finally:
                self.conservative.forget()
                self.steps.last_node = self.steps.span = None
                self.closed = True
                self.transfers.close()
                # Our references go; autograd's handles keep what a late unpack may still need.
                self.vars, self.by_storage, self.clean, self.clean_mover = [], {}, {}, None


__all__ = ["Counters", "Executor", "Profiled", "WholeModelCompiled", "PROFILE", "PLANNED", "FALLBACK", "DECLINED"]
