"""SwapManager: the context manager a training loop runs inside.

    with swap.SwapManager(budget="12GiB") as sm:
        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step(); opt.zero_grad()
    print(sm.report())

The first two iterations profile (conservatively, within the budget); later ones follow the optimized
schedule. If the run fits the budget without swapping, the manager declines after profiling and says so.
A budget no schedule can meet raises ``InfeasibleBudget`` as soon as a profiled iteration shows it; when the
manager can do nothing for the budget (nothing it may move, a device it never sees) it warns once with
``BudgetWarning``.

The manager wires the runtime's parts together, each in its own module: the arguments (swap.runtime.arguments),
the budget's default and the device's resources (swap.runtime.machine.resources), the saved-tensor hooks
(swap.runtime.activations.hooks), the executor (swap.runtime.activations.executor), what is done with a profile
(swap.runtime.scheduling), the joint runtime of ``strategy="auto"`` (swap.runtime.auto.joint), model state
(swap.runtime.model_state, joined to the executor by its ``wiring``), notes and warnings (swap.runtime.notices) and
the report's data (swap.runtime.snapshot).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Optional, Union

import torch

from ..schedule.budget import InfeasibleBudget
from ..schedule.model_state import ModelStatePolicy, policy_of
from ..schedule.scheduler import Schedule, validate
from ..schedule.sequence import Sequence
from ..units import Size, parse_size
from . import snapshot
from .activations.executor import Executor
from .activations.hooks import SavedTensorHooks
from .activations.signals import BudgetWarning
from .activations.tracer import Exclusions
from .arguments import check_arena, check_device, check_flag, check_steps, check_strategy, parse_window
from .auto.joint import JointRuntime
from .auto.ranks import Ranks
from .machine.memory import DeviceMemory, vmalloc_arena
from .machine.resources import (
    default_budget,
    host_block_bytes,
    note_refused,
    open_resources,
    refuse_budget_above_memory,
)
from .model_state import wiring
from .model_state.precision import check_compute_dtype
from .model_state.runtime import ModelStateRuntime, check_model_state
from .notices import NOT_STARTED, Notices, never_started
from .report import SwapReport
from .scheduling import Scheduling

_active_lock = threading.Lock()
_active: list[SwapManager] = []  # entered and not exited, process-wide


@dataclasses.dataclass(frozen=True)
class JointView:
    """What ``strategy="auto"`` decided and ran, and what the rebuilds made, when ``SwapManager.joint_view`` was
    read: a frozen copy, so tests, benchmarks and tools read the joint runtime without reaching into the manager's
    parts (and without changing them)."""

    searching: bool  # the manager runs the joint search (strategy="auto")
    decided: bool  # the search has run (at the last profiling iteration)
    result: Any  # its JointResult (``result.best.strategy.plan``: the RecomputePlan), None before or without one
    applied: bool  # checkpointed regions are wrapped around the model's modules now
    table: Any  # the profiled operator table (OpTable), None before profiling ends
    regions: Mapping[str, Any]  # region path -> a copy of its RegionStats (calls, reruns, scratch, rerun_marks...)
    rebuilding: bool  # rebuilds are on (recompute=True, or chosen by the search)
    rebuilt: int  # rebuilds run (one per backward use)
    rebuilt_bytes: int  # the bytes they made on the device instead of moving them


class SwapManager:
    """Swaps saved activations to host memory and back, under a device-memory budget.

    Args:
        budget: device bytes the run may use (int or "12GiB"). None: vmalloc's capacity when vmalloc is the
            CUDA allocator, else the device's free memory less 10% (CPU runs: available host memory less 10%).
            On a GPU it is the allocator's allocated bytes (vmalloc's held chunks: a slab counts whole while
            a block in it lives, so a budget equal to vmalloc's capacity fits). On the CPU it counts every live
            CPU tensor storage in the process, between operators, not only the training's: tensors made
            before the manager (another model, data, an unused ``torch.zeros``) count as soon as it is entered;
            delete them first or raise the budget by their size (Note [What the CPU budget counts] in
            swap.runtime.machine.memory).
        window: the window policy's look-ahead in bytes, or "auto" (chosen by simulating the profiled iteration on
            the measured link bandwidth and step times).
        policy: swap only, by this policy: "window" (the look-ahead window), "fixed_distance" (TFLMS:
            ``swapout_threshold``, ``swapin_ahead``), "all" (vDNN) or "none" (swap nothing). None (the default):
            the strategy decides (Note [Policy and strategy] in swap/__init__.py).
        min_bytes: saved storages smaller than this stay on the device.
        device: the compute device; None: the current CUDA device if CUDA is available, else "cpu".
        host_pool_limit: cap on host memory for swapped variables; None: no cap.
        exclude: a tensor, a module (its parameters and buffers), a predicate(tensor) -> bool, or a list of
            them: saved tensors they match stay put.
        arena: a ``vmalloc.Arena`` whose OOM handler the manager becomes (found automatically when vmalloc is
            the global CUDA allocator).
        recompute: rebuild saved outputs of GELU/SiLU/leaky ReLU from their saved inputs, and those of
            training-mode batch norm (and a ReLU on it) from the norm's saved input, at backward instead of
            swapping them (bitwise exact; fewer bytes over the link; swap.joint.recompute).
        strategy: "auto" (what runs when no policy is given): keep, swap or recompute each saved tensor,
            checkpointing modules of the model where that is faster than swapping them (Note [Applying a joint
            plan] in swap.runtime.auto.joint). ``policy="auto"`` still means this, with a DeprecationWarning.
        model, optimizer: the model and the torch optimizer that steps it (both or neither): their parameters,
            gradients and optimizer state then count against the budget too (swap.runtime.model_state). The loop
            is unchanged: ``opt.step()``, an LR scheduler, gradient accumulation, ``zero_grad``,
            ``torch.nn.utils.clip_grad_norm_`` (or ``sm.clip_grad_norm_``) and both state dicts work as in plain
            torch. Adam, AdamW and SGD are supported.
        model_state: with ``model=``, a ``swap.ModelStatePolicy`` (None: the default policy, ``placement="auto"``):
            where the model's state lives and how it moves. ``placement="auto"`` chooses per bucket under the
            budget, starting streamed; ``"streamed"`` streams every parameter through the device and steps it on
            the host (exact: the very optimizer, bitwise on CPU runs); ``"host_master"`` keeps a device compute
            copy of every bucket, where it fits; ``"resident"`` keeps the state on the device (as without
            ``model=``). Its ``bucket_bytes`` (None: the weights over 16 buckets, at most 1/32 of the budget,
            between 64 KiB and 32 MiB: Note [Bucket size by default]), ``host_memory`` (None: what the kernel
            reports available; the manager refuses at construction, ``HostMemoryError``, if the state would not
            fit) and ``host_threads``. The old spellings, a placement string (``"offload"``, ``"auto"``,
            ``"resident"``) and the ``bucket_bytes=`` / ``host_memory=`` arguments, still work with a
            FutureWarning naming the new one.
        bucket_bytes, host_memory: old spellings of ``ModelStatePolicy``'s fields (a FutureWarning).
        compute_dtype: with ``model=`` (placement "auto" or "streamed") and an fp32 model, mixed precision: fp32
            master weights, gradients and optimizer state on the host, the device computing with copies in this
            dtype (torch.bfloat16 or torch.float16), cast on the host so the link carries half the bytes; the
            model's floating-point inputs are cast to it. After the manager the parameters are the fp32 masters.
            None (the default): the parameters' own dtype (Note [Mixed precision] in
            swap.runtime.model_state.precision). The same as ``ModelStatePolicy(compute_dtype=...)``: give it one
            way.
        group: under DDP or FSDP2, the process group whose ranks choose ``strategy="auto"``'s plan together
            (Note [Ranks agree on a plan] in swap.runtime.auto.ranks): None, the default group when torch.distributed
            is initialised with more than one rank; False, each rank plans alone. Each rank keeps its own budget.

    Raises ``InfeasibleBudget`` (at the first saved tensor of the iteration after the one that showed it)
    when no schedule can keep the budget; warns once with ``BudgetWarning`` per cause when it cannot help
    keep it. One manager may be active at a time: autograd applies only the innermost saved-tensor hooks,
    so a nested manager would silently take over from the outer one, and entering one is refused.
    """

    def __init__(
        self,
        budget: Size = None,
        window: Union[int, str] = "auto",
        policy: Optional[str] = None,
        min_bytes: Size = "1MiB",
        device: Any = None,
        host_pool_limit: Size = None,
        exclude: Any = (),
        *,
        swapout_threshold: int = 2,
        swapin_ahead: int = 1,
        arena: Any = None,
        recompute: bool = False,
        strategy: Optional[str] = None,
        model: Optional[torch.nn.Module] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        model_state: Union[ModelStatePolicy, str, None] = None,
        bucket_bytes: Size = None,
        host_memory: Size = None,
        compute_dtype: Optional[torch.dtype] = None,
        group: Any = None,
    ) -> None:
        policy = self.policy = check_strategy(strategy, policy)  # "auto" or a policy
        self.device = check_device(device)
        self.arena = check_arena(arena) if arena is not None else vmalloc_arena(self.device)
        self.budget = parse_size(budget, "budget", minimum=1, none="vmalloc's capacity, or free memory less 10%")
        if self.budget is None:
            self.budget = default_budget(self.device, self.arena)
        else:
            refuse_budget_above_memory(self.budget, self.device, self.arena)
        if self.budget <= 0:
            raise ValueError(f"the budget must be positive, not {self.budget}")
        self.window: Optional[int] = parse_window(window)
        validate(self.budget, self.window, "window" if policy == "auto" else policy)
        self.min_bytes = parse_size(min_bytes, "min_bytes", none="0: every saved tensor may move") or 0
        self.host_pool_limit = parse_size(host_pool_limit, "host_pool_limit", minimum=1, none="no limit")
        self.exclude = Exclusions(exclude)
        self.swapout_threshold = check_steps(swapout_threshold, "swapout_threshold")
        self.swapin_ahead = check_steps(swapin_ahead, "swapin_ahead")
        self.hooks = SavedTensorHooks(self.device, self.min_bytes, self.exclude, check_flag(recompute, "recompute"))
        self.executor: Optional[Executor] = None
        self.memory: Optional[DeviceMemory] = None
        self._notices = Notices()
        self._scheduling: Optional[Scheduling] = None
        self._active = False
        self._joint: Optional[JointRuntime] = JointRuntime(self.device, self.budget) if policy == "auto" else None
        self._final: Optional[dict[str, Any]] = None
        self._group = group
        self.model_state: Optional[ModelStateRuntime] = None
        ms_policy = policy_of(model_state, bucket_bytes=bucket_bytes, host_memory=host_memory)
        if compute_dtype is not None:  # the argument, or the policy's field (Note [The model-state policy])
            if ms_policy.compute_dtype is not None and ms_policy.compute_dtype != compute_dtype:
                raise ValueError(f"compute_dtype={compute_dtype} and ModelStatePolicy(compute_dtype="
                                 f"{ms_policy.compute_dtype}) disagree: give it once")  # fmt: skip
            ms_policy = dataclasses.replace(ms_policy, compute_dtype=check_compute_dtype(compute_dtype, "auto"))
        run = check_model_state(model, optimizer, ms_policy)
        check_compute_dtype(ms_policy.compute_dtype, run.placement if run is not None else None)
        if run is not None and run.offloads:
            if policy == "none":
                raise ValueError("policy='none' turns the manager off, so it cannot place model state: pass another "
                                 "policy, or model_state=swap.ModelStatePolicy(placement='resident')")  # fmt: skip
            self.model_state = ModelStateRuntime(model, optimizer, self.device, run, budget=self.budget)

    @property
    def joint_view(self) -> JointView:
        """A read-only snapshot of the joint runtime and the rebuilds (``JointView``); read it again for later
        figures."""
        joint, rec = self._joint, self.hooks.recompute
        regions = joint.regions if joint is not None else None
        paths = regions.plan.paths if regions is not None and regions.plan is not None else []
        stats = {p: regions.stats_of(p) for p in paths} if regions is not None else {}
        copies = {p: dataclasses.replace(s, rerun_marks=list(s.rerun_marks), forced=dict(s.forced))
                  for p, s in stats.items() if s is not None}  # fmt: skip
        return JointView(
            searching=joint is not None, decided=joint is not None and joint.decided,
            result=joint.result if joint is not None else None, applied=joint is not None and joint.applied,
            table=joint.table if joint is not None else None, regions=MappingProxyType(copies),
            rebuilding=rec is not None, rebuilt=rec.rebuilt if rec is not None else 0,
            rebuilt_bytes=rec.rebuilt_bytes if rec is not None else 0,
        )  # fmt: skip

    # -- context manager --------------------------------------------------------------------------------
    def __enter__(self) -> SwapManager:
        if self._active:
            raise RuntimeError("this SwapManager is already active")
        with _active_lock:
            if _active:
                raise RuntimeError(
                    "a SwapManager is already active: nested managers are not supported (autograd applies only "
                    "the innermost saved-tensor hooks, so the inner one would take over every saved tensor and "
                    "the outer one would see none). Use one manager around the training loop."
                )
            _active.append(self)
        self._active = True
        if self.policy == "none":
            self._notices.note("policy='none': not swapping")
            return self
        try:
            self._start()
        except BaseException:
            self._active = False
            with _active_lock:
                _active.remove(self)
            raise
        return self

    def _start(self) -> None:
        """Opens the device's resources, builds the executor and installs the hooks."""
        self.memory, engine, pool = open_resources(self.device, self.arena, self.host_pool_limit)
        pool.block_size = host_block_bytes(self.budget)  # Note [The host pool's first block]
        s = self._scheduling = Scheduling(
            self.budget, self.window, self.policy, self.swapout_threshold, self.swapin_ahead, engine, self.hooks,
            self._notices, self._joint, Ranks.of(self._group) if self._joint is not None else None,
        )  # fmt: skip
        self.executor = Executor(self.device, engine, pool, self.memory, s.profiled, self.budget,
                                 replanner=s.schedule, warn=self._notices.warn, unmanaged=s.unmanaged)  # fmt: skip
        if self.arena is not None:
            self.arena.set_oom_handler(self.executor.evict)
        ms = self.model_state
        if ms is not None:  # before the operator profiler: its dispatch mode must sit above the guard's
            wiring.attach(ms, self.executor, engine, self.hooks, self.memory, self.budget)
            if ms.mode in ("auto", "host_master"):
                ms.decide = wiring.placer(self.executor, self.memory, self.budget, self._notices.note, ms.mode,
                                          ms.prediction.accumulation, engine, ms)  # fmt: skip
        self.hooks.install(self.executor, self._joint)
        if self._joint is not None:
            self._joint.start(self.executor, self.hooks)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Removes the hooks, drains the copy lanes and frees the host pool, also after an exception."""
        self._active = False
        with _active_lock:
            if self in _active:
                _active.remove(self)
        if exc_type is not None and issubclass(exc_type, InfeasibleBudget):
            note_refused()  # Note [Retrying after except InfeasibleBudget] (swap.runtime.machine.resources)
        if self.executor is None:
            self._final = self._snapshot()
            return
        try:
            if self._joint is not None:
                self._joint.close()
        finally:
            self._stop(exc_type, exc, tb)
            if exc_type is None and self._final is not None and self._final["status"] == "not started":
                self._final["status"] = NOT_STARTED  # Note [A manager that saw no training step]
                self._notices.warn("not started", never_started(torch.is_grad_enabled()))

    def _stop(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.hooks.uninstall(exc_type, exc, tb)
        finally:
            if self.arena is not None:
                self.arena.set_oom_handler(None)
            ex = self.executor
            self.memory.window_peak()
            try:
                if self.model_state is not None:
                    self.hooks.manage_params(None)
                    self.model_state.close()  # needs the copy engine; its guard sits below the profiler (closed)
            finally:
                self._stop_engine(ex)

    def _stop_engine(self, ex: Executor) -> None:
        try:
            ex.engine.drain()
            ex.close()
            ex.engine.close()
            self._final = self._snapshot()
        finally:
            ex.pool.close()
            self.memory.close()

    # -- results ----------------------------------------------------------------------------------------
    def _snapshot(self) -> dict[str, Any]:
        window = self._scheduling.window_used if self._scheduling is not None else self.window
        data = snapshot.snapshot(self.policy, self.device, self.budget, window, self.executor, self._joint,
                                 self.hooks.recompute)  # fmt: skip
        if self.model_state is not None:
            data["model_state"] = self.model_state.snapshot()
        return data

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, parameters: Any = None,
                        error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:  # fmt: skip
        """``torch.nn.utils.clip_grad_norm_`` over ``parameters`` (default: the model's), exact with gradients on
        the host (Note [Exact clipping] in swap.runtime.model_state.clipping); returns the total norm."""
        ms = self.model_state
        if parameters is None:
            if ms is None or ms.model is None:
                raise ValueError("no model to clip: pass parameters= (the manager was given no model=, or has exited)")
            parameters = ms.model.parameters()
        if ms is not None and ms.started:
            return ms.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)

    def flush(self) -> None:
        """Waits for every pending host step (Note [Host step after confirmation]); nothing to do without model
        state."""
        if self.model_state is not None and self.model_state.started:
            self.model_state.flush()

    def report(self) -> SwapReport:
        """Counters of the run so far (or of the whole run, after exit); ``print`` it for a table."""
        if self._active and self.memory is not None:
            self.memory.window_peak()
        data = self._snapshot() if self._active or self._final is None else dict(self._final)
        return snapshot.report(data, self._notices.notes)

    def save_profile(self, path: Any) -> Any:
        """Writes the profiled sequence, with measured per-step times (CUDA events on a GPU) and link
        bandwidths, for ``python -m bench.swap_schedule --profile FILE`` to simulate every policy on."""
        seq = self.sequence
        if seq is None:
            raise RuntimeError("nothing profiled yet: run at least three training iterations inside the manager "
                               "(two profile, the third's start plans)")  # fmt: skip
        h2d, d2h = self._scheduling.rates()
        meta = {
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "h2d_bandwidth": h2d,
            "d2h_bandwidth": d2h,
            "budget": self.budget,
            "torch": torch.__version__,
        }
        return seq.save(path, meta)

    @property
    def schedule(self) -> Optional[Schedule]:
        return self.executor.schedule if self.executor else None

    @property
    def sequence(self) -> Optional[Sequence]:
        """The sequence planned on, else the last one profiled (None before the first profile ends)."""
        return self.executor.lifecycle.latest if self.executor is not None else None


__all__ = ["SwapManager", "JointView", "InfeasibleBudget", "BudgetWarning"]
