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
import timeit
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from bench.write import write_results
from swap.devices import HostProfile, host_step_bytes

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


def optimizer_rate(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer], name: str) -> float:
    p = torch.nn.Parameter(torch.ones(STEP_PARAMS))
    p.grad = torch.full_like(p, 1e-3)
    opt = make([p])
    seconds = median_seconds(opt.step)
    return host_step_bytes(name, STEP_PARAMS, 4, 4) / seconds


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
