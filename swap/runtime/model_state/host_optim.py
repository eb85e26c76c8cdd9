"""The host step's kernel and threads: torch's fused CPU kernel by default, on a thread budget of its own.

Note [The host kernel]
torch steps CPU tensors with its per-tensor loop unless told otherwise (``foreach`` and ``fused`` left at
``None``); its fused CPU kernel (Adam, AdamW, SGD) is one multi-threaded call over a bucket, several times
faster (``python -m bench.host_profile``) and the rate the forecast prices the host step at. So where the
user's optimizer leaves torch's default, the host step runs ``fused=True``: a host-only setting of the shadow
optimizer (Note [Shadow optimizer]); the user's optimizer, its param groups and its state dicts keep the user's
flags. What it is bitwise against: plain training with the same kernel, i.e. the user's optimizer with
``fused=True`` (on CPU runs; on the device the resident buckets are stepped by the user's own kernel). Its
update is elementwise, so neither the buckets nor the thread count change a bit. Where the user chose a kernel
(``foreach=`` or ``fused=False``) or an option fused cannot run (``differentiable=True``), the host step runs the
user's kernel and a ``UserWarning`` says why it is slower and what to change; the report names the kernel.

Note [Host threads]
The host step runs on one worker thread, and torch's intra-op threads of that thread do the work: the fused
kernel holds no GIL while it runs (one call a bucket), so the thread launching device work, or computing on CPU
runs, keeps running Python. The budget: on a device, every core this process may use but one (left for the
thread that launches device work); on CPU runs, the cores the main thread's intra-op threads leave, at least one.
torch keeps an intra-op thread count per thread (OpenMP's) but also one process-wide value that threads not yet
initialised copy on their first parallel call: the worker sets its own after initialising, and the main thread,
initialised first, puts the process-wide value back. A torch built with its own thread pool instead of OpenMP
has one count for every thread: there the worker runs on it as it is.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

# Optimizer classes with a fused CPU kernel in torch (checked when the shadow is built: a build without one falls
# back to the user's kernel, with the warning).
FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


@dataclass(frozen=True)
class HostKernel:
    """The kernel the host step runs: ``name`` ("fused", "foreach" or "for-loop"), the host-only settings over the
    user's (``overrides``), and why it is not the fused one (``slow``: None when it is)."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    slow: Optional[str] = None


def _user_kernel(groups: list[dict[str, Any]]) -> str:
    if any(g.get("fused") for g in groups):
        return "fused"
    return "foreach" if any(g.get("foreach") for g in groups) else "for-loop"


def user_kernel(groups: list[dict[str, Any]]) -> HostKernel:
    """The user's own kernel, as asked (no warning: the caller keeps it by design)."""
    return HostKernel(_user_kernel(groups))


def choose(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> HostKernel:
    """Note [The host kernel]: the kernel for ``optimizer``'s ``groups`` holding offloaded parameters."""
    name = type(optimizer).__name__
    if all(g.get("fused") for g in groups):
        return HostKernel("fused")
    if not isinstance(optimizer, FUSED):
        return HostKernel(_user_kernel(groups), slow=f"{name} has no fused CPU kernel in torch")
    chosen = sorted({f"{k}={g[k]!r}" for g in groups for k in ("foreach", "fused") if g.get(k) is not None})
    if chosen:
        return HostKernel(_user_kernel(groups), slow=f"{name} was made with {', '.join(chosen)}")
    if any(g.get("differentiable") for g in groups):
        return HostKernel(_user_kernel(groups), slow=f"{name} was made with differentiable=True, which the fused "
                                                      "kernel does not support")  # fmt: skip
    return HostKernel("fused", {"fused": True})


def fallback(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]], error: Exception) -> HostKernel:
    """The user's own kernel, where the fused one failed to build (``error``)."""
    why = f"torch's fused {type(optimizer).__name__} is not available on the host ({error})"
    return HostKernel(_user_kernel([{**g, "fused": None} for g in groups]), {"fused": None}, slow=why)


def warn_slow(kernel: HostKernel) -> None:
    """The UserWarning of a host step that cannot run the fused kernel: why, and what to change."""
    if kernel.slow is None:
        return
    warnings.warn(f"the offloaded model state's host step runs the {kernel.name} kernel, not torch's fused CPU "
                  f"kernel, because {kernel.slow}: it is several times slower (python -m bench.host_profile "
                  "measures both). For the fast one, use Adam, AdamW or SGD and leave foreach= and fused= unset "
                  "(or pass fused=True)", UserWarning, stacklevel=3)  # fmt: skip


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def host_threads(device: torch.device, available: Optional[int] = None, compute: Optional[int] = None) -> int:
    """Note [Host threads]: the host step's intra-op threads (``available`` cores, ``compute``: the main thread's
    intra-op threads on CPU runs; None: this process's)."""
    available = cores() if available is None else available
    if device.type != "cpu":
        return max(1, available - 1)
    compute = torch.get_num_threads() if compute is None else compute
    return max(1, available - compute)


def _init_worker(threads: int) -> None:
    torch.get_num_threads()  # torch's per-thread initialisation first, or it would undo the next line
    torch.set_num_threads(threads)


def host_worker(device: torch.device, threads: Optional[int] = None) -> tuple[ThreadPoolExecutor, int]:
    """The host step's worker thread with its threads (``threads``; None: Note [Host threads]), and their number."""
    main = torch.get_num_threads()  # also initialises this thread's own count, before the worker changes torch's
    if "OpenMP" not in torch.__config__.parallel_info():  # one count for all threads: leave it as it is
        return ThreadPoolExecutor(1, thread_name_prefix="swap-host-step"), main
    threads = host_threads(device, compute=main) if threads is None else threads
    worker = ThreadPoolExecutor(1, thread_name_prefix="swap-host-step", initializer=_init_worker,
                                initargs=(threads,))  # fmt: skip
    worker.submit(lambda: None).result()  # the worker initialised now ...
    torch.set_num_threads(main)  # ... so that torch's process-wide count can be put back
    return worker, threads
