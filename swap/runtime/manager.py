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
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from dataclasses import replace
from typing import Any, Optional, Union

import torch

from ..schedule.budget import InfeasibleBudget, diagnose, min_budget, refuse_over_memory
from ..schedule.scheduler import POLICIES, Schedule, validate
from ..schedule.sequence import Sequence
from ..schedule.simulator import schedule_for
from ..units import Size, fmt_bytes, parse_size, size_arg
from .engines import CudaEngine, HostEngine
from .executor import DECLINED, PLANNED, PROFILE, Counters, Executor, Profiled
from .host_pool import HostPool
from .joint import JointRuntime
from .lifecycle import Reprofile
from .memory import ArenaMemory, DeviceMemory, MeterMemory, TorchCudaMemory, vmalloc_arena
from .recompute import RecomputeHooks
from .report import SwapReport
from .signals import BudgetWarning
from .tracer import Exclusions, is_parameter_like, passthrough

log = logging.getLogger("swap")

DEFAULT_BANDWIDTH = 10e9  # bytes/s, until copies have been measured

_active_lock = threading.Lock()
_active: list[SwapManager] = []  # entered and not exited, process-wide


def _strategy(strategy: Optional[str], policy: Optional[str]) -> str:
    """What the manager runs: "auto" (``strategy="auto"``, the default) or a policy (``policy=`` alone: swap
    only). ``policy="auto"`` is the old spelling of ``strategy="auto"`` and warns (Note [Policy and strategy]
    in swap/__init__.py)."""
    if policy == "auto":
        warnings.warn("SwapManager(policy='auto') is spelled SwapManager(strategy='auto') now: 'auto' is a strategy "
                      "(keep, swap or recompute), a policy is how saved tensors are swapped", DeprecationWarning,
                      stacklevel=3)  # fmt: skip
        policy, strategy = None, strategy or "auto"
    if strategy is not None and strategy != "auto":
        raise ValueError(f"unknown strategy {strategy!r}: SwapManager runs strategy='auto' (keep, swap or recompute "
                         f"each saved tensor), or swaps only with policy= one of {', '.join(map(repr, POLICIES))}")
    if strategy == "auto" and policy is not None:
        raise ValueError(f"strategy='auto' chooses how to swap itself: pass strategy='auto' or policy={policy!r}, "
                         "not both")  # fmt: skip
    if policy is None:
        return "auto"
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: choose one of {', '.join(map(repr, POLICIES))}, or "
                         "strategy='auto' to keep, swap or recompute")  # fmt: skip
    return policy


def _steps(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int number of steps (>= 1), not {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{what} must be at least 1 step (got {value})")
    return value


def _device(device: Any) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    forms = "'cpu', 'cuda', 'cuda:N', an int or a torch.device"
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device must be {forms}, not {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device must be {forms}, not {device!r}") from None
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be a CUDA device or 'cpu', not {dev}")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


class SwapManager:
    """Swaps saved activations to host memory and back, under a device-memory budget.

    Args:
        budget: device bytes the run may use (int or "12GiB"). None: vmalloc's capacity when vmalloc is the
            CUDA allocator, else the device's free memory less 10% (CPU runs: available host memory less 10%).
        window: the window policy's look-ahead in bytes, or "auto" (chosen by simulating the profiled iteration on the
            measured link bandwidth and step times).
        policy: swap only, by this policy: "window" (the look-ahead window), "fixed_distance" (TFLMS:
            ``swapout_threshold``, ``swapin_ahead``), "all" (vDNN) or "none" (swap nothing). None (the default):
            the strategy decides (Note [Policy and strategy] in swap/__init__.py).
        strategy: "auto" (what runs when no policy is given): keep, swap or recompute each saved tensor,
            checkpointing modules of the model where that is faster than swapping them (Note [Applying a joint
            plan] in swap.runtime.joint). ``policy="auto"`` still means this, with a DeprecationWarning.
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
    ) -> None:
        policy = self.policy = _strategy(strategy, policy)  # "auto" or a policy
        self.device = _device(device)
        if arena is not None and not (hasattr(arena, "set_oom_handler") and hasattr(arena, "capacity")):
            raise TypeError(
                f"arena must be a vmalloc.Arena (or None: found automatically when vmalloc is the CUDA "
                f"allocator), not {arena!r} ({type(arena).__name__})"
            )
        self.arena = arena if arena is not None else vmalloc_arena(self.device)
        self.budget = parse_size(budget, "budget", minimum=1, none="vmalloc's capacity, or free memory less 10%")
        if self.budget is None:
            self.budget = self._default_budget()
        else:
            self._refuse_budget_above_memory()
        if self.budget <= 0:
            raise ValueError(f"the budget must be positive, not {self.budget}")
        if isinstance(window, str) and window.strip().lower() == "auto":
            self.window: Optional[int] = None
        else:
            try:
                self.window = parse_size(window, "window", minimum=1)
            except (TypeError, ValueError) as e:
                message = str(e)
                if "window must be a number" in message:
                    message = message.replace("window must be ", "window must be 'auto' or ", 1)
                else:
                    message += "; or pass window='auto'"
                raise type(e)(message) from None
        validate(self.budget, self.window, "window" if policy == "auto" else policy)
        self.min_bytes = parse_size(min_bytes, "min_bytes", none="0: every saved tensor may move") or 0
        self.host_pool_limit = parse_size(host_pool_limit, "host_pool_limit", minimum=1, none="no limit")
        self.exclude = Exclusions(exclude)
        self.swapout_threshold = _steps(swapout_threshold, "swapout_threshold")
        self.swapin_ahead = _steps(swapin_ahead, "swapin_ahead")
        self.executor: Optional[Executor] = None
        self.memory: Optional[DeviceMemory] = None
        self._hooks: Any = None
        self._notes: list[str] = []
        self._warned: set[Any] = set()
        self._window_used: Optional[int] = self.window
        self._active = False
        if not isinstance(recompute, bool):
            raise TypeError(f"recompute must be True or False, not {recompute!r} ({type(recompute).__name__})")
        self._recompute = RecomputeHooks() if recompute else None  # Note [Recompute or swap]
        self._joint: Optional[JointRuntime] = JointRuntime(self) if policy == "auto" else None
        self._in_hooks = 0  # depth inside our saved-tensor hooks (the operator profiler skips what runs there)
        self._final: Optional[dict[str, Any]] = None
        self._skipped: dict[str, list[int]] = {}  # profiling: why saved tensors stayed -> [count, bytes]
        self._profile_skips: dict[str, list[int]] = {}  # ... in the last profiled iteration
        self._other_devices: set[str] = set()
        self._cpu = self.device == torch.device("cpu")  # the device check on the hot path

    def _default_budget(self) -> int:
        if self.arena is not None:
            return int(self.arena.capacity)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return int(free - total // 10)
        return int(_available_host_memory() * 0.9)

    def _refuse_budget_above_memory(self) -> None:
        """Note [A budget above the device's memory] (swap/schedule/budget.py): on a CUDA device, vmalloc's
        capacity (when it is the allocator) or else the device's total memory; nothing on the CPU."""
        if self.device.type != "cuda":
            return
        if self.arena is not None:
            limit, what = int(self.arena.capacity), f"vmalloc's capacity on {self.device}"
            otherwise = ("budget=None (the capacity); or raise the capacity (arena.set_capacity(...), or "
                         "vmalloc.configure(capacity=...) before the first CUDA allocation)")  # fmt: skip
        else:
            limit = int(torch.cuda.get_device_properties(self.device).total_memory)
            what = f"the memory of {self.device}"
            otherwise = "budget=None (free memory less 10%)"
        refuse_over_memory(self.budget, limit, what, f"pass budget={size_arg(limit)!r} or less, or {otherwise}")

    # -- signals ----------------------------------------------------------------------------------------
    def _warn(self, cause: Any, message: str) -> None:
        """A ``BudgetWarning``, once per cause; also kept in the report's notes."""
        if cause in self._warned:
            return
        self._warned.add(cause)
        self._notes.append(message)
        warnings.warn(f"swap: {message}", BudgetWarning, stacklevel=3)

    def _note(self, message: str) -> None:
        log.info("swap: %s", message)
        if message not in self._notes:
            self._notes.append(message)

    # -- planning ---------------------------------------------------------------------------------------
    def _profiled(self, p: Profiled) -> Union[Schedule, Reprofile, None]:
        """A profiling iteration ended: raise if no plan can fit, warn if the manager cannot help, and (after
        the last one) decline or plan."""
        seq = p.sequence
        self._profile_skips, self._skipped = self._skipped, {}  # the next iteration counts afresh
        self._nothing_to_do(seq, max(p.peak, p.unswapped_peak or 0))
        joint = self._joint
        if seq is None:
            if p.final and joint is not None:  # nothing to plan: the operator profiler must not tax every later step
                joint.profiling_done()
            return None
        undecided = joint is not None and not joint.decided  # recompute may still fit what swapping cannot
        if not p.final:
            if diagnose(seq, self.budget) is not None:  # Note [Two profiling iterations]: certain already
                grown, note = seq, "Measured in the first iteration"
                if p.growth:
                    grown = replace(seq, nonswap=[b + p.growth for b in seq.nonswap[:-1]] + seq.nonswap[-1:],
                                    base=seq.base + p.growth)
                    note += (f", plus the {fmt_bytes(p.growth)} live from the second on (optimizer state, "
                             "gradients): every step needs it too")  # fmt: skip
                if not undecided or not joint.may_fit(grown, self.budget):
                    raise diagnose(grown, self.budget, note)
            return None
        error = diagnose(seq, self.budget)
        if error is not None and not undecided:
            raise error
        need = p.unswapped_peak if p.unswapped_peak is not None else seq.no_swap_peak()
        # With recompute regions applied, the swaps are planned on what was measured with them, even if none is
        # needed: the peak a run without swapping would reach is measured for the saved-tensor hooks' tensors,
        # not for the ones a checkpoint's frame holds (Note [Applying a joint plan]).
        applied = joint is not None and joint.applied
        if error is None and need <= self.budget and self.executor.allow_decline and not applied:
            if joint is not None:
                joint.profiling_done()
            self._note(f"the run fits the budget without swapping (peak {fmt_bytes(need)} <= "
                       f"{fmt_bytes(self.budget)}): not swapping")  # fmt: skip
            return None
        if undecided:
            engine = self.executor.engine
            again = joint.decide(seq, engine.h2d_bw.rate(DEFAULT_BANDWIDTH), engine.d2h_bw.rate(DEFAULT_BANDWIDTH))
            if again is not None:
                return again
        if error is not None:
            raise error
        return self._schedule(seq, need)

    def _schedule(self, seq: Sequence, no_swap: Optional[int] = None) -> Schedule:
        engine = self.executor.engine
        h2d = engine.h2d_bw.rate(DEFAULT_BANDWIDTH)
        d2h = engine.d2h_bw.rate(DEFAULT_BANDWIDTH)
        policy = self._joint.swap_policy if self._joint is not None else self.policy
        window, schedule, _ = schedule_for(
            seq, self.budget, policy, h2d, d2h, window=self.window,
            swapout_threshold=self.swapout_threshold, swapin_ahead=self.swapin_ahead,
        )  # fmt: skip
        self._window_used = window
        no_swap = seq.no_swap_peak() if no_swap is None else no_swap
        log.info(
            "swap: planned %d steps, %d variables: peak %.1f MiB of budget %.1f MiB (%.1f MiB without swapping)%s",
            len(seq), len(seq.sizes), schedule.peak / 2**20, self.budget / 2**20, no_swap / 2**20,
            f", window {window / 2**20:.1f} MiB" if window else "",
        )  # fmt: skip
        return schedule

    # Note [Nothing to move, over the budget]
    # One condition warns: the highest memory measured is over the budget and the manager may move nothing
    # (every saved tensor is under min_bytes, excluded, a parameter, or alive elsewhere). It is judged wherever
    # a peak is measured: at the end of each profiling iteration, and, once the manager has declined with
    # nothing to manage, after every backward pass (the executor's ``unmanaged`` callback). Judging it at the
    # profiles alone missed runs whose memory grows after them: with gradient accumulation the two profiled
    # iterations are micro-batches that run before the optimizer has made its state, and a later iteration
    # (longer sequences, a larger batch) can need more. The BudgetWarning and the report's note are one
    # call (``_warn``): the same text, once per cause. The counts in it are of one profiled iteration.
    def _nothing_to_do(self, seq: Optional[Sequence], peak: int) -> None:
        """BudgetWarning when the manager cannot move what the budget needs moved, naming the cause: Note
        [Nothing to move, over the budget]. ``seq``: the profiled sequence (None: nothing was recorded, or a
        later iteration); ``peak``: the highest memory measured."""
        skipped = {k: v for k, v in self._profile_skips.items() if v[1] > 0}
        movable = 0 if seq is None else sum(b for b, s in zip(seq.sizes, seq.swappable) if s)
        if self._other_devices and (seq is None or not seq.sizes):
            self._warn("device", (
                f"saved tensors were on {', '.join(sorted(self._other_devices))}, none on the manager's device "
                f"{self.device}: nothing is managed and the budget is not enforced; pass "
                f"device={sorted(self._other_devices)[0]!r}"
            ))  # fmt: skip
            return
        if movable > 0 or peak <= self.budget:
            return
        reasons = {
            "min_bytes": f"smaller than min_bytes={self.min_bytes} (lower min_bytes)",
            "exclude": "matched by exclude= (exclude less)",
            "parameter": "parameters or views of them (they are not activations)",
            "expanded": "expanded (stride-0) views",
        }
        causes = [f"{n} saved tensor(s), {fmt_bytes(b)}, {reasons[k]}" for k, (n, b) in skipped.items()]
        if seq is not None and seq.sizes:
            causes.append(f"{len(seq.sizes)} saved storage(s), {fmt_bytes(sum(seq.sizes))}, stay alive elsewhere "
                          "(referenced outside autograd, so moving them frees nothing)")  # fmt: skip
        cause = next((k for k in ("min_bytes", "exclude") if k in skipped), "nothing")
        self._warn(cause, (
            f"nothing can be swapped, and the run reaches {fmt_bytes(peak)}, over the budget of "
            f"{fmt_bytes(self.budget)}: " + ("per iteration, " + "; ".join(causes) if causes
                                             else "no tensor was saved for backward inside the manager")
        ))  # fmt: skip

    # -- hooks ------------------------------------------------------------------------------------------
    def _skip_reason(self, t: torch.Tensor) -> Optional[str]:
        """Why a saved tensor stays where it is (None: the executor takes it). Cheapest checks first."""
        if not t.is_cpu if self._cpu else t.device != self.device:
            return "device"
        n = t.untyped_storage().nbytes()
        if n < self.min_bytes or n == 0:
            return "min_bytes" if n else "other"
        if is_parameter_like(t):
            return "parameter"
        if type(t) is not torch.Tensor or t.layout != torch.strided:
            return "other"
        if 0 in t.stride() and t.numel() > 1:
            return "expanded"  # copying it back could not restore the aliasing
        if self.exclude and self.exclude(t):
            return "exclude"
        return None

    def _pack(self, t: torch.Tensor) -> Any:
        joint = self._joint
        if joint is None:
            return self._take(t)
        ex = self.executor
        if ex._backward_done and not ex._in_backward:
            joint.boundary()
        self._in_hooks += 1
        try:
            packed = self._take(t)
        finally:
            self._in_hooks -= 1
        if ex.mode == PROFILE:
            joint.saved(t, packed)
        return packed

    def _keep(self, t: torch.Tensor) -> Any:
        """A kept operator's output in a recompute region (swap.runtime.regions): saved like any saved tensor,
        never rebuilt (its producer's saved input lives in the checkpoint, out of our reach)."""
        self._in_hooks += 1
        try:
            return self._take(t, rebuild=False)
        finally:
            self._in_hooks -= 1

    def _hook_pair(self) -> Any:
        """The (pack, unpack) pair autograd calls, to tell our hooks from others (Note [Whose checkpoint])."""
        h = self._hooks
        return (h.pack_hook, h.unpack_hook) if h is not None else None

    def _take(self, t: torch.Tensor, rebuild: bool = True) -> Any:
        ex = self.executor
        if ex.mode == DECLINED and self._recompute is None:
            return ex.pack(t)
        reason = self._skip_reason(t)
        if reason is None:
            if rebuild and self._recompute is not None and (rebuilt := self._recompute.pack(t)) is not None:
                return rebuilt
            return ex.pack(t)
        if rebuild and self._recompute is not None:
            self._recompute.saving()  # a node's saved input we keep may still be a rebuild's source
        ex.observe(t)
        if ex.mode == PROFILE:
            self._note_skip(t, reason)
        return passthrough(t)

    def _note_skip(self, t: torch.Tensor, reason: str) -> None:
        if reason == "device":
            self._other_devices.add(str(t.device))
            return
        if reason in ("min_bytes", "exclude"):
            self.executor.note_kept(t)
        entry = self._skipped.setdefault(reason, [0, 0])
        entry[0] += 1
        entry[1] += t.untyped_storage().nbytes()

    def _unpack(self, packed: Any) -> torch.Tensor:
        self._in_hooks += 1
        try:
            if self._recompute is not None and self._recompute.intercepts(packed):
                return self._recompute.unpack(packed, self.executor.unpack)
            return self.executor.unpack(packed)
        finally:
            self._in_hooks -= 1

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
            self._note("policy='none': not swapping")
            return self
        try:
            cuda = self.device.type == "cuda"
            if cuda:
                memory: DeviceMemory = (
                    ArenaMemory(self.arena) if self.arena is not None else TorchCudaMemory(self.device)
                )
                engine: Any = CudaEngine(self.device)
            else:
                memory = MeterMemory(self.device)
                engine = HostEngine()
            self.memory = memory
            pool = HostPool(pinned=cuda, limit=self.host_pool_limit)
            self.executor = Executor(
                self.device, engine, pool, memory, self._profiled, self.budget,
                replanner=self._schedule, warn=self._warn, unmanaged=lambda peak: self._nothing_to_do(None, peak),
            )  # fmt: skip
            if self.arena is not None:
                self.arena.set_oom_handler(self.executor.evict)
            # Note [Hooks and torch.compile]: dynamo must run the hooks, not trace them.
            self._hooks = torch.autograd.graph.saved_tensors_hooks(
                torch._dynamo.disable(self._pack), torch._dynamo.disable(self._unpack)
            )
            self._hooks.__enter__()
            if self._joint is not None:
                self._joint.start()
        except BaseException:
            self._active = False
            with _active_lock:
                _active.remove(self)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Removes the hooks, drains the copy lanes and frees the host pool, also after an exception."""
        self._active = False
        with _active_lock:
            if self in _active:
                _active.remove(self)
        if self.executor is None:
            self._final = self._snapshot()
            return
        try:
            if self._joint is not None:
                self._joint.close()
        finally:
            self._exit_hooks(exc_type, exc, tb)

    def _exit_hooks(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if self._hooks is not None:
                self._hooks.__exit__(exc_type, exc, tb)
        finally:
            self._hooks = None
            if self.arena is not None:
                self.arena.set_oom_handler(None)
            ex = self.executor
            self.memory.window_peak()
            ex.engine.drain()
            ex.close()
            ex.engine.close()
            self._final = self._snapshot()
            ex.pool.close()
            self.memory.close()

    # -- results ----------------------------------------------------------------------------------------
    def _status(self) -> str:
        ex = self.executor
        if self.policy == "none":
            return "declined (policy 'none')"
        if ex is None or (ex.iteration == 0 and ex.counters.iterations == 0):
            return "not started"
        return {PROFILE: "profiling", PLANNED: "planned", DECLINED: "declined"}.get(ex.mode, "re-profiling")

    def _snapshot(self) -> dict[str, Any]:
        ex = self.executor
        base = {
            "status": self._status(), "policy": self.policy, "device": str(self.device),
            "budget_bytes": self.budget, "window_bytes": self._window_used,
        }  # fmt: skip
        if ex is None:  # not entered yet, or policy 'none': nothing ran
            c = vars(Counters())
            return {**base, **c, "peak_device_bytes": None, "declined": self.policy == "none",
                    "memory_source": None, "peak_measured_inside_ops": None}  # fmt: skip
        c = ex.counters
        seq = ex.sequence or ex._previous
        return {
            **base,
            "iterations": c.iterations,
            "swapped_out_bytes": c.swapped_out_bytes,
            "swapped_in_bytes": c.swapped_in_bytes,
            "demand_fetches": c.demand_fetches,
            "stall_seconds": c.stall_seconds,
            "peak_device_bytes": self.memory.peak if c.iterations or ex.iteration else None,
            "replans": c.replans,
            "overruns": c.overruns,
            "evictions": c.evictions,
            "declined": ex.mode == DECLINED,
            "planned_peak_bytes": ex.schedule.peak if ex.schedule is not None else None,
            "no_swap_peak_bytes": (ex._unswapped_peak if ex._unswapped_peak is not None
                                   else seq.no_swap_peak() if seq is not None else None),  # fmt: skip
            "min_budget_bytes": min_budget(seq) if seq is not None else None,
            "variables_per_iteration": len(seq.sizes) if seq is not None else None,
            "host_pool_bytes": ex.pool.reserved,
            "host_pool_peak_used_bytes": ex.pool.peak_used,
            "memory_source": self.memory.name,
            "peak_measured_inside_ops": self.memory.sees_inside_ops,
            **(self._joint.snapshot(seq, ex.schedule if ex.mode == PLANNED else None) if self._joint else {}),
            **({"rebuilds": self._recompute.rebuilt, "rebuilt_bytes": self._recompute.rebuilt_bytes}
               if self._recompute is not None else {}),  # fmt: skip
        }

    def report(self) -> SwapReport:
        """Counters of the run so far (or of the whole run, after exit); ``print`` it for a table."""
        if self._active and self.memory is not None:
            self.memory.window_peak()
        data = self._snapshot() if self._active or self._final is None else dict(self._final)
        notes = list(self._notes)
        if data["status"] == "not started":
            notes.insert(0, "not started: no training iteration has run inside the manager yet")
        if data.get("peak_measured_inside_ops") is False:
            notes.append(
                "on CPU the budget is measured as live tensor bytes between operators (swap.LiveBytesMeter): "
                "memory an operator allocates and frees inside itself is not seen; on a GPU the allocator's "
                "own peak is measured, which is the truth"
            )
        data["notes"] = notes
        return SwapReport(data)

    def save_profile(self, path: Any) -> Any:
        """Writes the profiled sequence, with measured per-step times (CUDA events on a GPU) and link
        bandwidths, for ``python -m bench.swap_schedule --profile FILE`` to simulate every policy on."""
        seq = self.sequence
        if seq is None:
            raise RuntimeError("nothing profiled yet: run at least three training iterations inside the manager "
                               "(two profile, the third's start plans)")  # fmt: skip
        engine = self.executor.engine
        meta = {
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "h2d_bandwidth": engine.h2d_bw.rate(DEFAULT_BANDWIDTH),
            "d2h_bandwidth": engine.d2h_bw.rate(DEFAULT_BANDWIDTH),
            "budget": self.budget,
            "torch": torch.__version__,
        }
        return seq.save(path, meta)

    @property
    def schedule(self) -> Optional[Schedule]:
        return self.executor.schedule if self.executor else None

    @property
    def sequence(self) -> Optional[Sequence]:
        ex = self.executor
        if ex is None:
            return None
        return ex.sequence if ex.sequence is not None else ex._previous


__all__ = ["SwapManager", "InfeasibleBudget", "BudgetWarning"]
