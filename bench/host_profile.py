"""A host profile of this machine (Note [Host profiles] in swap/devices.py), measured.

    python -m bench.host_profile            # ~1 minute; writes bench/results/host_profile.{json,md}
    python -m swap.plan --host bench/results/host_profile.json ...   # plan with it

What it measures, with PyTorch's own CPU kernels on every intra-op thread the process has (the host step
runs on all of them; the planner's CPU device profile uses one, for other reasons: Note [The CPU as a
device] in bench/cpu_profile.py):

- ``dram_bandwidth``: bytes/s of ``dst.copy_(src)`` between fp32 tensors of ``COPY_MIB`` each, far past the
  last-level cache, counting what is read and what is written (STREAM's convention): the median of repeats.
- ``optimizer_rates``: bytes/s of DRAM traffic of a host step, ``swap.devices.host_step_bytes`` over its
  seconds, for ``torch.optim.AdamW`` and ``SGD`` (momentum 0.9) on one fp32 parameter of ``STEP_PARAMS``
  elements with an fp32 gradient (so ``grad`` is 4 bytes and there is no separate copy): each
  implementation PyTorch has on CPU (``fused``, ``foreach``, the per-tensor loop), and the fastest kept.
- ``memory``: physical memory (``os.sysconf``); ``pinnable``: the smaller of that and ``RLIMIT_MEMLOCK``,
  which does not bind root (CAP_IPC_LOCK: page-locking is then limited by memory alone).
- no link: a CPU-only machine has none (the device profile's apply).

Times are wall-clock medians: a host step's worth is the wall time the training loop waits for it. On a
machine shared with other jobs the figures are lower than the hardware's, and say so in the result.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import time
import timeit
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import torch

from bench.write import write_results
from swap.devices import HostProfile, host_step_bytes
from swap.runtime.model_state import speculation

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results"
COPY_MIB = 256
STEP_PARAMS = 32 << 20  # 32 M fp32 parameters: 128 MiB each of master, gradient and every state tensor
REPEATS = 7


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def median_seconds(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    """Wall-clock median of ``repeats`` calls, after one to warm (first touch of fresh pages is not the cost)."""
    fn()
    return statistics.median(timeit.repeat(fn, number=1, repeat=repeats))


def copy_bandwidth() -> float:
    n = COPY_MIB * (1 << 20) // 4
    src, dst = torch.ones(n), torch.empty(n)
    return 2 * src.nbytes / median_seconds(lambda: dst.copy_(src))


def optimizer_rate(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer], name: str,
                   numels: Sequence[int] = (STEP_PARAMS,), *, save: bool = False,
                   worker: Optional[Executor] = None, beside: Optional[Callable[[], object]] = None,
                   arrivals: Optional[Sequence[float]] = None, repeats: int = REPEATS) -> float:  # fmt: skip
    """Bytes/s of DRAM traffic of a host step (``host_step_bytes`` over its wall-clock median seconds): one fp32
    parameter of each of ``numels`` elements (one optimizer call each, as the runtime steps a bucket at a time),
    fp32 gradients; the seconds are the calls' own, summed (as the runtime times its host step).

    Note [Measuring the host step where it runs]
    The profile's own figure is one call over ``STEP_PARAMS`` on this thread. ``bench.host_step_overlap`` measures
    the same way, but as the runtime runs it, in the process right before the run it prices: the runtime's
    buckets' sizes (``numels``), each its own task on the host step's worker (``worker``:
    ``host_optim.host_worker``, its thread count), queued ``arrivals`` seconds after the start (when the run's
    gradients became final, for a speculative step; none: all at once, as at ``opt.step()``), while this thread
    runs ``beside`` in a loop (the compute the host step shares the cores, DRAM and the GIL with on a CPU run), and
    for a speculative step (``save``) each bucket's rollback copies first (``speculation.save`` into buffers kept
    from the last step, as the runtime makes them; in the seconds, not in the bytes: the rate is the speculative
    step's). Each of these moves the seconds on a machine shared with other jobs (issue 37, item 6: the
    prediction 2-5x high): a rate measured minutes away from the run is another load's; the same work queued with
    pauses between the buckets ran about twice as fast as back to back (measured once, at a load of 7; a guess at
    why: the scheduler wakes a thread that slept ahead of the other jobs' threads); the compute thread takes cores
    and the GIL."""
    params = [torch.nn.Parameter(torch.ones(n)) for n in numels]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = make(params)
    group = opt.param_groups[0]
    spare: dict[int, dict] = {}

    def bucket(p: torch.nn.Parameter) -> float:
        t0 = time.perf_counter()
        if save:
            speculation.save(opt.state, [p], spare)
        group["params"] = [p]
        opt.step()
        group["params"] = params
        return time.perf_counter() - t0

    def step() -> float:
        if worker is None:
            return sum(bucket(p) for p in params)
        futures, start = [], time.perf_counter()
        for p, at in zip(params, arrivals or [0.0] * len(params)):
            time.sleep(max(0.0, start + at - time.perf_counter()))
            futures.append(worker.submit(bucket, p))
        return sum(f.result() for f in futures)

    def timed() -> float:
        step()  # the state's and the copies' first allocation is not the cost
        return statistics.median(step() for _ in range(repeats))

    if beside is None:
        seconds = timed()
    else:  # the buckets queued from a thread of their own, this one computing meanwhile
        with ThreadPoolExecutor(1, thread_name_prefix="host-profile-queue") as queue:
            future = queue.submit(timed)
            while not future.done():
                beside()
            seconds = future.result()
    return host_step_bytes(name, sum(numels), 4, 4) / seconds


def variants(name: str) -> dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]:
    if name == "adamw":
        base = lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-3, **kw)  # noqa: E731
    else:
        base = lambda ps, **kw: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, **kw)  # noqa: E731
    return {"fused": lambda ps: base(ps, fused=True), "foreach": lambda ps: base(ps, foreach=True),
            "for-loop": lambda ps: base(ps, foreach=False)}  # fmt: skip


def measure() -> tuple[HostProfile, dict]:
    """This machine's host profile, and every figure measured on the way."""
    threads = torch.get_num_threads()
    log(f"host profile: {platform.processor() or platform.machine()}, {threads} intra-op threads")
    dram = copy_bandwidth()
    log(f"  copy: {dram / 1e9:.1f} GB/s")
    rates: dict[str, float] = {}
    detail: dict[str, dict[str, float]] = {}
    for name in ("adamw", "sgd"):
        detail[name] = {}
        for impl, make in variants(name).items():
            try:
                detail[name][impl] = optimizer_rate(make, name)
            except (RuntimeError, TypeError) as e:  # an implementation this build lacks on CPU
                log(f"  {name} {impl}: not available ({e})")
                continue
            log(f"  {name} {impl}: {detail[name][impl] / 1e9:.1f} GB/s of DRAM traffic")
        rates[name] = max(detail[name].values())
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    lock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    unlimited = lock in (resource.RLIM_INFINITY, -1) or os.geteuid() == 0
    pinnable = memory if unlimited else min(memory, lock)
    host = HostProfile(
        f"this machine ({platform.node()}, {threads} threads), measured", dram, rates, memory, pinnable,
        source="bench/host_profile.py: torch copy_ and optimizer steps, wall-clock medians",
    )  # fmt: skip
    return host, {"threads": threads, "optimizer_variants": detail}


def markdown(host: HostProfile, extra: dict) -> str:
    lines = [
        "# Host profile of this machine (measured)", "",
        f"- command: `python -m bench.host_profile`; torch {torch.__version__}, {extra['threads']} intra-op threads,"
        f" {platform.platform()}",
        f"- DRAM (torch copy_, {COPY_MIB} MiB fp32, read + written): {host.dram_bandwidth / 1e9:.1f} GB/s",
        f"- memory {host.memory / 2**30:.1f} GiB, pinnable {host.pinnable / 2**30:.1f} GiB", "",
        "| optimizer | implementation | DRAM traffic GB/s | params/s (fp32 master and grad) |", "|---|---|---|---|",
    ]  # fmt: skip
    for name, impls in extra["optimizer_variants"].items():
        per = host_step_bytes(name, 1, 4, 4)
        for impl, rate in impls.items():
            lines.append(f"| {name} | {impl} | {rate / 1e9:.2f} | {rate / per / 1e6:.0f} M |")
    lines += ["", "The fastest implementation's rate is the profile's. This machine is shared and small: the figures "
              "are for checking the planner against this machine, not a model of a training host (the built-in "
              "`desktop-ddr5-2ch` and `server-ddr5-8ch` are those)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    host, extra = measure()
    write_results(args.out, "host_profile", {"profile": asdict(host), **extra}, markdown(host, extra))


if __name__ == "__main__":
    main()
