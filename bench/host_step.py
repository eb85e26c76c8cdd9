"""The model-state runtime's host step against the DRAM bound, measured on this machine's CPU.

    python -m bench.host_step --short      # ~1 minute; writes bench/results/host_step.{json,md}

For each intra-op thread count (1, powers of two, every core), AdamW on ``PARAMS`` fp32 parameters split in
``TENSORS`` tensors (a bucket of a model's weights), stepped by:

- the kernel torch runs on CPU tensors by default (the per-tensor loop: ``foreach`` and ``fused`` unset), what
  the runtime ran before Note [The host kernel];
- torch's fused CPU kernel, what the runtime runs for that optimizer now (``host_optim.choose``);

as params/s and GB/s of DRAM traffic (``swap.devices.host_step_bytes``: 28 bytes an fp32 AdamW parameter), over
the DRAM bound: ``a.add_(b)`` bytes/s at the same thread count (read + written, in place as AdamW writes), so
"of bound" is the share of the machine's streaming bandwidth the step's traffic reaches.

Then the runtime's worker as it runs (``host_optim.host_worker`` for a device: every core but one, Note [Host
threads]), with the main thread running Python meanwhile: ``main_python_share`` is the main thread's loop rate
while the host step runs over its rate alone, which shows how much of the step holds the GIL.

Wall-clock medians. The machine is shared: figures are lower than the hardware's.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from bench.write import write_results
from swap.devices import host_step_bytes
from swap.runtime.model_state import host_optim

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results"
PARAMS, TENSORS, REPEATS = 32 << 20, 64, 5
SHORT = (8 << 20, 64, 3)
COPY_MIB = 256
PER_PARAM = host_step_bytes("adamw", 1, 4, 4)  # fp32 master, state and gradient


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def median_seconds(fn: Callable[[], object], repeats: int, threads: int = 1) -> tuple[float, float]:
    """Median wall seconds of a call, and median CPU seconds of the process over ``threads`` (the time it ran:
    on a machine shared with other jobs, wall time also counts the time it waited for a core)."""
    fn()  # first touch of fresh pages (and the state's allocation) is not the cost
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append((time.process_time() - c0) / threads)
    return statistics.median(wall), statistics.median(cpu)


def dram_bandwidth(repeats: int, threads: int) -> tuple[float, float]:
    """Bytes/s of ``a.add_(b)`` (two tensors read, one written back in place, as AdamW updates its tensors: no
    write-allocate read uncounted, unlike a copy into a fresh destination): by wall time and by CPU time."""
    n = COPY_MIB * (1 << 20) // 4
    a, b = torch.ones(n), torch.ones(n)
    wall, cpu = median_seconds(lambda: a.add_(b), repeats, threads)
    return 3 * a.nbytes / wall, 3 * a.nbytes / cpu


def optimizer(params: int, tensors: int, **flags: Any) -> torch.optim.Optimizer:
    ps = [torch.nn.Parameter(torch.ones(params // tensors)) for _ in range(tensors)]
    for p in ps:
        p.grad = torch.full_like(p, 1e-3)
    return torch.optim.AdamW(ps, lr=1e-3, **flags)


def kernels(params: int, tensors: int) -> dict[str, Callable[[], torch.optim.Optimizer]]:
    """The default loop, and what the runtime runs for it (its host-only overrides)."""
    user = optimizer(8, 8)
    kernel = host_optim.choose(user, user.param_groups)
    assert kernel.name == "fused", kernel
    return {"default (for-loop)": lambda: optimizer(params, tensors),
            "runtime (fused)": lambda: optimizer(params, tensors, **kernel.overrides)}  # fmt: skip


def spin_beside(worker: ThreadPoolExecutor, job: Callable[[], object]) -> tuple[float, float]:
    """Python loop iterations a second on this thread while ``job`` runs on ``worker``, and the job's seconds."""
    n, t0 = 0, time.perf_counter()
    f = worker.submit(job)
    while not f.done():
        for _ in range(256):
            n += 1
    seconds = time.perf_counter() - t0
    f.result()
    return n / seconds, seconds


def on_worker(make: Callable[[], torch.optim.Optimizer], repeats: int) -> dict[str, float]:
    """The host step on the runtime's worker, the main thread spinning Python meanwhile; its Python rate over its
    rate beside a worker that sleeps as long (holding no GIL: the control, under the same load)."""
    worker, threads = host_optim.host_worker(torch.device("cuda"))  # the device budget: every core but one
    try:
        opt = worker.submit(make).result()
        worker.submit(opt.step).result()
        seconds, shares = [], []
        for _ in range(repeats):
            rate, s = spin_beside(worker, opt.step)
            control, _ = spin_beside(worker, functools.partial(time.sleep, s))
            seconds.append(s)
            shares.append(rate / control)
    finally:
        worker.shutdown()
    s = statistics.median(seconds)
    return {"threads": threads, "seconds": s, "params_per_s": opt_params(opt) / s,
            "main_python_share": statistics.median(shares)}  # fmt: skip


def opt_params(opt: torch.optim.Optimizer) -> int:
    return sum(p.numel() for g in opt.param_groups for p in g["params"])


def measure(params: int, tensors: int, repeats: int) -> dict[str, Any]:
    load = os.getloadavg()[0]
    main = torch.get_num_threads()
    n = host_optim.cores()
    counts = sorted({1, n, *(1 << k for k in range(n.bit_length()) if 1 << k <= n)})
    rows = []
    for t in counts:
        torch.set_num_threads(t)
        bound, bound_cpu = dram_bandwidth(repeats, t)
        for name, make in kernels(params, tensors).items():
            opt = make()
            s, cpu = median_seconds(opt.step, repeats, t)
            rate, rate_cpu = params / s, params / cpu
            rows.append({"threads": t, "kernel": name, "seconds": s, "cpu_seconds": cpu, "params_per_s": rate,
                         "gb_per_s": rate * PER_PARAM / 1e9, "dram_gb_per_s": bound / 1e9,
                         "of_bound": rate * PER_PARAM / bound, "params_per_cpu_s": rate_cpu,
                         "dram_gb_per_cpu_s": bound_cpu / 1e9,
                         "of_bound_cpu": rate_cpu * PER_PARAM / bound_cpu})  # fmt: skip
            log(f"  {t} threads, {name}: {rate / 1e6:.0f} M params/s, {rate * PER_PARAM / 1e9:.2f} GB/s "
                f"({rate * PER_PARAM / bound:.0%} of add_ {bound / 1e9:.1f} GB/s); by CPU time "
                f"{rate_cpu / 1e6:.0f} M params/s, {rate_cpu * PER_PARAM / bound_cpu:.0%} of add_")  # fmt: skip
            del opt
    torch.set_num_threads(main)
    worker = {name: on_worker(make, repeats) for name, make in kernels(params, tensors).items()}
    for name, w in worker.items():
        log(f"  worker ({w['threads']} threads), {name}: {w['params_per_s'] / 1e6:.0f} M params/s, main thread's "
            f"Python at {w['main_python_share']:.0%}")  # fmt: skip
    return {"params": params, "tensors": tensors, "repeats": repeats, "cores": n, "bytes_per_param": PER_PARAM,
            "load_average": [load, os.getloadavg()[0]], "rows": rows, "worker": worker}  # fmt: skip


def markdown(r: dict[str, Any], command: str) -> str:
    lines = [
        "# The host step against the DRAM bound (measured on this machine's CPU)", "",
        f"- command: `{command}`; torch {torch.__version__}, {r['cores']} cores, {platform.platform()}",
        f"- AdamW, {r['params'] / 2**20:.0f} Mi fp32 parameters in {r['tensors']} tensors, "
        f"{r['bytes_per_param']} bytes of DRAM traffic a parameter; medians of {r['repeats']}",
        f"- load average (1 min) at the start and the end: {r['load_average'][0]:.1f}, {r['load_average'][1]:.1f} "
        f"on {r['cores']} cores (other jobs)", "",
        "Wall: seconds on the clock; CPU: the process's CPU seconds over the threads (the time it ran, which a "
        "machine shared with other jobs does not give it all of the wall time).", "",
        "| threads | kernel | params/s | GB/s | add_ GB/s (bound) | of bound | vs default | by CPU time: params/s, "
        "of bound |", "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    default = {row["threads"]: row["params_per_s"] for row in r["rows"] if row["kernel"].startswith("default")}
    for row in r["rows"]:
        lines.append(f"| {row['threads']} | {row['kernel']} | {row['params_per_s'] / 1e6:.0f} M | "
                     f"{row['gb_per_s']:.2f} | {row['dram_gb_per_s']:.2f} | {row['of_bound']:.0%} | "
                     f"{row['params_per_s'] / default[row['threads']]:.1f}x | "
                     f"{row['params_per_cpu_s'] / 1e6:.0f} M, {row['of_bound_cpu']:.0%} |")  # fmt: skip
    lines += ["", "On the runtime's worker (`host_optim.host_worker`, a device's budget: every core but one), the "
              "main thread running Python meanwhile (its loop rate over its rate beside a worker that sleeps "
              "as long, under the same load):", "",
              "| kernel | worker threads | params/s | main thread's Python rate beside it |",
              "|---|---|---|---|"]  # fmt: skip
    for name, w in r["worker"].items():
        lines.append(f"| {name} | {w['threads']} | {w['params_per_s'] / 1e6:.0f} M | {w['main_python_share']:.0%} |")
    lines += ["", "This machine is shared with other jobs and small: the figures are lower than its hardware's, and "
              "threads beyond the cores other jobs leave idle slow OpenMP kernels down (the 2-thread rows). The "
              "CPU-time columns are the rate while the kernel ran; the main thread's share mixes the GIL with "
              "the cores the other jobs take."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--short", action="store_true", help=f"{SHORT[0] >> 20} Mi parameters, {SHORT[2]} repeats")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    params, tensors, repeats = SHORT if args.short else (PARAMS, TENSORS, REPEATS)
    r = measure(params, tensors, repeats)
    command = "python -m bench.host_step" + (" --short" if args.short else "")
    write_results(args.out, "host_step", r, markdown(r, command))


if __name__ == "__main__":
    main()
