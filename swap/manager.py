"""SwapManager: the context manager a training loop runs inside.

    with swap.SwapManager(budget="12GiB") as sm:
        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step(); opt.zero_grad()
    print(sm.report())

The first two iterations profile (conservatively, within the budget); later ones follow the optimized
schedule. If the run fits the budget without swapping, the manager declines after profiling and says so.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any, Optional, Union

import torch

from .engines import CudaEngine, HostEngine
from .executor import DECLINED, Counters, Executor
from .host_pool import HostPool
from .memory import ArenaMemory, DeviceMemory, MeterMemory, TorchCudaMemory, vmalloc_arena
from .recompute import RecomputeHooks
from .report import SwapReport
from .scheduler import POLICIES, Schedule, plan, validate
from .sequence import Sequence
from .simulator import choose_window
from .tracer import Exclusions, is_parameter_like

log = logging.getLogger("swap")
Size = Union[int, str, None]

DEFAULT_BANDWIDTH = 10e9  # bytes/s, until copies have been measured


def parse_size(value: Size, what: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{what} must be an int or a string such as '12GiB', not {type(value).__name__}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what} must not be negative (got {value})")
        return value
    from vmalloc import parse_size as vparse

    return vparse(value)


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
        window: seed 001's look-ahead in bytes, or "auto" (chosen by simulating the profiled iteration on the
            measured link bandwidth and step times).
        policy: "window", "fixed_distance" (TFLMS: ``swapout_threshold``, ``swapin_ahead``), "all" (vDNN) or
            "none" (swap nothing).
        min_bytes: saved storages smaller than this stay on the device.
        device: the compute device; None: the current CUDA device if CUDA is available, else "cpu".
        host_pool_limit: cap on host memory for swapped variables; None: no cap.
        exclude: tensors or modules (their parameters and buffers) that stay put, or predicates(tensor)->bool.
        arena: a ``vmalloc.Arena`` whose OOM handler the manager becomes (found automatically when vmalloc is
            the global CUDA allocator).
        recompute: rebuild saved outputs of GELU/SiLU/leaky ReLU from their saved inputs at backward instead
            of swapping them (bitwise exact; fewer bytes over the link; swap.recompute).
    """

    def __init__(
        self,
        budget: Size = None,
        window: Union[int, str] = "auto",
        policy: str = "window",
        min_bytes: Size = "1MiB",
        device: Any = None,
        host_pool_limit: Size = None,
        exclude: Iterable[Any] = (),
        *,
        swapout_threshold: int = 2,
        swapin_ahead: int = 1,
        arena: Any = None,
        recompute: bool = False,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}: choose one of {', '.join(POLICIES)}")
        self.policy = policy
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"device must be a CUDA device or 'cpu', not {self.device}")
        self.arena = arena if arena is not None else vmalloc_arena(self.device)
        self.budget = parse_size(budget, "budget")
        if self.budget is None:
            self.budget = self._default_budget()
        if self.budget <= 0:
            raise ValueError(f"the budget must be positive, not {self.budget}")
        if window == "auto":
            self.window: Optional[int] = None
        else:
            self.window = parse_size(window, "window")
            if isinstance(window, str) and not any(c.isdigit() for c in window):
                raise ValueError(f"window must be 'auto' or a size in bytes, not {window!r}")
        validate(self.budget, self.window, policy)
        self.min_bytes = parse_size(min_bytes, "min_bytes") or 0
        self.host_pool_limit = parse_size(host_pool_limit, "host_pool_limit")
        self.exclude = Exclusions(exclude)
        if swapout_threshold < 1 or swapin_ahead < 1:
            raise ValueError("swapout_threshold and swapin_ahead must be at least 1 step")
        self.swapout_threshold, self.swapin_ahead = swapout_threshold, swapin_ahead
        self.executor: Optional[Executor] = None
        self.memory: Optional[DeviceMemory] = None
        self._hooks: Any = None
        self._notes: list[str] = []
        self._window_used: Optional[int] = self.window
        self._active = False
        self._recompute = RecomputeHooks() if recompute else None  # Note [Recompute or swap]

    def _default_budget(self) -> int:
        if self.arena is not None:
            return int(self.arena.capacity)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return int(free - total // 10)
        return int(_available_host_memory() * 0.9)

    # -- planning ---------------------------------------------------------------------------------------
    def _plan(self, seq: Sequence) -> Optional[Schedule]:
        no_swap = seq.no_swap_peak()
        if no_swap <= self.budget:
            note = (
                f"the run fits the budget without swapping (peak {no_swap / 2**20:.1f} MiB <= "
                f"{self.budget / 2**20:.1f} MiB): not swapping"
            )
            log.info("swap: %s", note)
            self._notes.append(note)
            return None
        engine = self.executor.engine
        h2d = engine.h2d_bw.rate(DEFAULT_BANDWIDTH)
        d2h = engine.d2h_bw.rate(DEFAULT_BANDWIDTH)
        if self.policy == "window" and self.window is None:
            window, schedule, _ = choose_window(seq, self.budget, h2d, d2h)
        else:
            window = self.window
            schedule = plan(
                seq, self.budget, window, self.policy,
                swapout_threshold=self.swapout_threshold, swapin_ahead=self.swapin_ahead,
            )  # fmt: skip
        self._window_used = window
        log.info(
            "swap: planned %d steps, %d variables: peak %.1f MiB of budget %.1f MiB (%.1f MiB without swapping)%s",
            len(seq), len(seq.sizes), schedule.peak / 2**20, self.budget / 2**20, no_swap / 2**20,
            f", window {window / 2**20:.1f} MiB" if window else "",
        )  # fmt: skip
        return schedule

    # -- hooks ------------------------------------------------------------------------------------------
    def _eligible(self, t: torch.Tensor) -> bool:
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.device != self.device:
            return False
        if is_parameter_like(t):
            return False
        if t.numel() > 1 and 0 in t.stride():
            return False  # an expanded view: copying it back could not restore the aliasing
        if t.untyped_storage().nbytes() < self.min_bytes:
            return False
        return not self.exclude(t)

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._eligible(t):
            return t
        if self._recompute is not None and (rebuilt := self._recompute.pack(t)) is not None:
            return rebuilt
        return self.executor.pack(t)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if self._recompute is not None and self._recompute.intercepts(packed):
            return self._recompute.unpack(packed, self.executor.unpack)
        return self.executor.unpack(packed)

    # -- context manager --------------------------------------------------------------------------------
    def __enter__(self) -> SwapManager:
        if self._active:
            raise RuntimeError("this SwapManager is already active")
        self._active = True
        if self.policy == "none":
            note = "policy='none': not swapping"
            log.info("swap: %s", note)
            self._notes.append(note)
            return self
        cuda = self.device.type == "cuda"
        if cuda:
            memory: DeviceMemory = ArenaMemory(self.arena) if self.arena is not None else TorchCudaMemory(self.device)
            engine: Any = CudaEngine(self.device)
        else:
            memory = MeterMemory(self.device)
            engine = HostEngine()
        self.memory = memory
        pool = HostPool(pinned=cuda, limit=self.host_pool_limit)
        self.executor = Executor(self.device, engine, pool, memory, self._plan, self.budget)
        if self.arena is not None:
            self.arena.set_oom_handler(self.executor.evict)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Removes the hooks, drains the copy lanes and frees the host pool, also after an exception."""
        self._active = False
        if self.executor is None:
            return
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
    def _snapshot(self) -> dict[str, Any]:
        ex = self.executor
        if ex is None:  # policy 'none': nothing ran
            c = Counters()
            return {"policy": self.policy, "device": str(self.device), **vars(c), "peak_device_bytes": None,
                    "budget_bytes": self.budget, "window_bytes": self.window, "declined": True}  # fmt: skip
        c = ex.counters
        return {
            "policy": self.policy,
            "device": str(self.device),
            "iterations": c.iterations,
            "swapped_out_bytes": c.swapped_out_bytes,
            "swapped_in_bytes": c.swapped_in_bytes,
            "demand_fetches": c.demand_fetches,
            "stall_seconds": c.stall_seconds,
            "peak_device_bytes": self.memory.peak,
            "budget_bytes": self.budget,
            "window_bytes": self._window_used,
            "replans": c.replans,
            "evictions": c.evictions,
            "declined": ex.mode == DECLINED,
            "planned_peak_bytes": ex.schedule.peak if ex.schedule is not None else None,
            "no_swap_peak_bytes": ex.sequence.no_swap_peak() if ex.sequence is not None else None,
            "variables_per_iteration": len(ex.sequence.sizes) if ex.sequence is not None else None,
            "host_pool_bytes": ex.pool.reserved,
            "host_pool_peak_used_bytes": ex.pool.peak_used,
            "memory_source": self.memory.name,
        }

    def report(self) -> SwapReport:
        """Counters of the run so far (or of the whole run, after exit); ``print`` it for a table."""
        if self._active and self.memory is not None:
            self.memory.window_peak()
        data = self._snapshot() if self._active or self.executor is None else dict(self._final)
        data["notes"] = list(self._notes)
        return SwapReport(data)

    def save_profile(self, path: Any) -> Any:
        """Writes the profiled sequence, with measured per-step times (CUDA events on a GPU) and link
        bandwidths, for ``python -m bench.swap_schedule --profile FILE`` to simulate every policy on."""
        seq = self.sequence
        if seq is None:
            raise RuntimeError("nothing profiled yet: run at least two training iterations inside the manager")
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
        return self.executor.sequence if self.executor else None
