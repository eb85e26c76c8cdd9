"""Model state on CUDA: a Llama-shaped model trained with ``SwapManager(model=, optimizer=)`` under a budget below
its weights + AdamW state, bitwise against an oracle, and its speed against plain GPU training and a
CPU-offload-optimizer baseline.

    python -m bench.gpu.model_state_gpu [--size 1b|200m|tiny] [--device cuda|cpu] [--budget 4GiB] [--lag]
        [--allocator native|vmalloc] [--fp32-masters] [--runs plain ours reference auto cpu_offload] [--out DIR]
        [--name NAME]

Runs, each from the same seeded weights, the same batches and the same loop (``ACCUM`` micro-batches a step,
AdamW with two param groups):
- ``plain``: everything on the device, the user's AdamW there; unbounded. The throughput ceiling.
  (``--fp32-masters``: fp32 masters and bf16 compute copies, both on the device: Note [Model state dtype].)
- ``ours``: ``ModelStatePolicy(placement="streamed")``: every bucket streamed, the host steps it.
- ``reference``: the oracle. The same forward and backward on the device, then the gradients copied to the host
  and torch's AdamW run over host copies of the parameters with the kernel the runtime's host step reported
  (Note [The host kernel]), and the parameters copied back (``--fp32-masters``: each backward's bf16 gradients
  upcast and accumulated into fp32 host masters, which are cast back to bf16: Note [Model state dtype]).
  ``ours`` must equal it bitwise: every loss, the final parameters and the final AdamW state. Its speed is the
  naive offload's.
- ``auto``: ``placement="auto"`` (some buckets may stay resident and step on the device: not bitwise; the
  largest loss difference against the reference is given. With ``--fp32-masters`` no bucket stays resident:
  the plan's resident buckets become host masters, Note [Mixed precision]).
- ``sgd_exit`` (asked for by the late-copies phase): row 6 of the model-state review, the weights copied back at
  exit with stateless SGD, bitwise against SGD on host copies.
- ``cpu_offload``: torchao's ``CPUOffloadOptimizer`` schedule, written here (bench/gpu/cpu_offload.py): the
  parameters resident, each gradient copied to pinned host memory as it is accumulated, fused AdamW on the host
  per parameter and each parameter copied back. Unbounded; its peak is given.

Note [Model state dtype]
Users train in mixed precision: an fp32 model, bf16 compute, fp32 masters, gradients and AdamW state
(``ModelStatePolicy(compute_dtype=torch.bfloat16)``, Note [Mixed precision] in
swap/runtime/model_state/precision.py). ``--fp32-masters`` runs that format (the lease asks for it): the model is
built in fp32, ``ours`` and ``auto`` pass ``compute_dtype=torch.bfloat16``, and ``plain`` and ``reference`` train
in the same format by hand (bench/gpu/mixed_precision.py, Note [The bench's mixed-precision oracle]; plain with
its masters on the device, the oracle with them on the host), so the oracle stays bitwise. ``cpu_offload`` keeps
torchao's schedule (parameters resident in the model's dtype): under ``--fp32-masters`` it computes in fp32, and
the results' ``notes`` say so. Without the flag the model is built in bf16 and trains pure bf16 (bf16 masters and
AdamW state). ``compute_dtype`` in the results says which ran.

Deterministic kernels, strictly (Note [Deterministic kernels, strictly] in tests/gpu/swap_worker.py), so that
the oracle and ours can be compared bit for bit. Results are written to DIR/NAME.json after every run, so a run
cut short keeps what it measured. ``--lag`` delays every copy of the swap engine (Note [Late copies],
bench/gpu/lag.py); on the CPU (``--device cpu``, the lease's smoke mode) there are no copy streams to delay,
and the results say so.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from bench.gpu import common
from bench.gpu.mixed_precision import MixedPrecision

GiB = 1 << 30
MiB = 1 << 20
# layers, d_model, heads, kv heads, d_ff, vocab; seq, micro-batches a step, default budget (at least the model as it
# enters: Note [A budget the model enters within])
SIZES: dict[str, dict[str, Any]] = {
    "1b": {"shape": (22, 2048, 32, 4, 5632, 32000), "seq": 2048, "accum": 4, "budget": 4 * GiB},
    "200m": {"shape": (12, 1024, 16, 4, 2816, 32000), "seq": 2048, "accum": 2, "budget": 3 * GiB // 2},
    "tiny": {"shape": (2, 64, 4, 2, 128, 256), "seq": 32, "accum": 2, "budget": None},
}
RUNS = ["plain", "ours", "reference", "auto", "cpu_offload", "sgd_exit"]
DEFAULT_RUNS = RUNS[:-1]  # sgd_exit: the late-copies phase asks for it
LR, WD = 1e-4, 0.1


class Config:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        s = SIZES[args.size]
        self.size, self.shape, self.seq, self.accum = args.size, s["shape"], s["seq"], args.accum or s["accum"]
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.steps, self.warmup = args.steps, args.warmup
        self.budget_arg, self.default_budget = args.budget, s["budget"]
        self.lag, self.allocator, self.fp32_masters = args.lag, args.allocator, args.fp32_masters
        self.bucket = "64KiB" if args.size == "tiny" else "32MiB"
        self.min_bytes = "16KiB" if args.size == "tiny" else "1MiB"
        self.dtype = torch.float32 if self.fp32_masters else torch.bfloat16

    def build(self) -> Any:
        import torch

        from swap.forecast import zoo

        torch.manual_seed(0)
        with torch.device(self.device):
            model = zoo.llama(*self.shape)
        return model.to(self.dtype)

    def batch(self, step: int, micro: int) -> tuple[Any, Any]:
        import torch

        g = torch.Generator().manual_seed(1000 * step + micro)
        t = torch.randint(0, self.shape[5], (1, self.seq + 1), generator=g)
        return t[:, :-1].to(self.device), t[:, 1:].to(self.device)

    def tokens_per_step(self) -> int:
        return self.seq * self.accum


def adamw(params: list[Any], **kw: Any) -> Any:
    """AdamW with two param groups (no weight decay on norms), as fine-tuning loops make it."""
    import torch

    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=LR, weight_decay=WD, **kw)


def digest(tensors: list[Any]) -> str:
    """sha256 over the tensors' own sha256s, in order (Note [Digests without copies])."""
    from concurrent.futures import ThreadPoolExecutor

    def one(t: Any) -> bytes:
        import torch

        flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        return hashlib.sha256(memoryview(flat)).digest()  # hashlib reads the buffer; no bytes object is made

    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        parts = list(pool.map(one, tensors))
    return hashlib.sha256(b"".join(parts)).hexdigest()


# Note [Digests without copies]
# Each run digests its parameters and AdamW state: 13.2 GB for the 1B model with fp32 masters. The digest made a
# bytes copy of every tensor (``numpy().tobytes()``) and hashed them one after another on the main thread; plain
# training's 1B run took 29 s for 1.7 s of steps in the 2026-11-28 H200 lease's rerun (the reference 36 s for
# 15.6 s), most of the rest building the model and digesting it (a guess from those numbers: no finer timing was
# kept). Each tensor is now hashed from its buffer, on a few threads (hashlib lets go of the GIL), and the
# digest is the sha256 of the tensors' sha256s: equal exactly when every tensor's bytes are, like the old one,
# though its values differ from the old one's (they are only ever compared within one run of this script).


class StackSampler:
    """Where the main thread is, sampled every ``interval`` seconds from another thread while active: for the
    warm-up step of a managed run, whose first step cost 88 s of the 1B run's 128 s on the 2026-11-28 H200
    lease (later steps 5.3-5.6 s) with no trace of where. Per sample, every function of swap/ on the stack
    counts once (cumulative, as a profiler's cumulative time: the planner's entry and its hot loop both show),
    and so does the innermost frame of all; ``top()`` gives the most seen, in seconds."""

    def __init__(self, interval: float = 0.25) -> None:
        import threading

        self.interval = interval
        self.main = threading.main_thread().ident
        self.swap: dict[str, int] = {}
        self.inner: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started (exiting twice, or never entered, is harmless)
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.main)
            if frame is None:
                continue
            key = f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_code.co_name}"
            self.inner[key] = self.inner.get(key, 0) + 1
            seen, f = set(), frame
            while f is not None:
                name = f.f_code.co_filename
                if "/swap/" in name:
                    seen.add(f"swap/{name.split('/swap/', 1)[1]}:{f.f_code.co_name}")
                f = f.f_back
            for key in seen:
                self.swap[key] = self.swap.get(key, 0) + 1

    def top(self, n: int = 20) -> dict[str, Any]:
        def best(counts: dict[str, int]) -> list[tuple[str, float]]:
            return [(k, round(c * self.interval, 2)) for k, c in sorted(counts.items(), key=lambda kv: -kv[1])[:n]]

        return {"in_swap_cumulative": best(self.swap), "innermost": best(self.inner),
                "samples": sum(self.inner.values()), "interval_seconds": self.interval}


def state_tensors(opt: Any) -> list[Any]:
    """AdamW's moments in parameter order (the step counts aside: their type depends on the kernel)."""
    sd = opt.state_dict()["state"]
    return [sd[i][k] for i in sorted(sd) for k in ("exp_avg", "exp_avg_sq") if k in sd[i]]


class Timer:
    """Per micro-batch: main-thread CPU seconds and device seconds (CUDA events; the host clock on the CPU)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.cpu, self.gpu, self._pending = cuda, [], [], []
        self.wall: list[float] = []  # host seconds each micro-batch took to return (no device sync)

    def __call__(self, fn: Callable[[], Any]) -> Any:
        import torch

        c0, w0 = time.thread_time(), time.perf_counter()
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            self._pending.append((a, b))
        else:
            t0 = time.perf_counter()
            out = fn()
            self.gpu.append(time.perf_counter() - t0)
        self.cpu.append(time.thread_time() - c0)
        self.wall.append(time.perf_counter() - w0)
        return out

    def settle(self) -> None:
        for a, b in self._pending:
            self.gpu.append(a.elapsed_time(b) / 1e3)
        self._pending = []


def sync(cfg: Config) -> None:
    import torch

    if cfg.cuda:
        torch.cuda.synchronize()


def train(cfg: Config, model: Any, opt: Any, step_fn: Callable[[], None], manager: Any = None,
          after_backward: Callable[[], None] = lambda: None, after_micro: Callable[[], None] = lambda: None,
          before_exit: Callable[[], None] = lambda: None) -> dict[str, Any]:  # fmt: skip
    """The loop every run shares: ``cfg.steps`` steps of ``cfg.accum`` micro-batches, ``after_micro()`` after each
    one's backward, ``step_fn()`` for the optimizer step. Returns losses (repr), step seconds, per micro-batch
    timings."""
    import contextlib

    import torch
    import torch.nn.functional as F

    losses, seconds, timer = [], [], Timer(cfg.cuda)
    optimizer_seconds: list[float] = []
    sampler = StackSampler() if manager is not None else None
    peak = torch_peak = None
    with contextlib.ExitStack() as stack:
        t_start = time.perf_counter()
        if sampler is not None:
            stack.callback(sampler.__exit__, None, None, None)  # stopped also when the first step raises
        if manager is not None:
            if cfg.cuda and cfg.allocator == "native":  # an earlier run's peak must not bound this run's windows
                torch.cuda.reset_peak_memory_stats()  # (Note [Window peaks without resetting torch's peak])
            stack.enter_context(manager)
        start_seconds = time.perf_counter() - t_start
        for step in range(cfg.steps):
            if cfg.cuda and step == cfg.warmup and manager is None:
                torch.cuda.reset_peak_memory_stats()
            sync(cfg)
            if sampler is not None and step == 0:
                sampler.__enter__()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            step_losses = []
            for micro in range(cfg.accum):
                x, y = cfg.batch(step, micro)

                def micro_batch(x: Any = x, y: Any = y) -> Any:
                    logits = model(x)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                    (loss / cfg.accum).backward()
                    return loss.detach()

                step_losses.append(timer(micro_batch))
                after_micro()
            after_backward()
            t1 = time.perf_counter()
            step_fn()
            sync(cfg)
            optimizer_seconds.append(time.perf_counter() - t1)
            seconds.append(time.perf_counter() - t0)
            if sampler is not None and step == 0:
                sampler.__exit__(None, None, None)
            timer.settle()
            losses += [repr(v) for v in torch.stack(step_losses).float().tolist()]
        if cfg.cuda and manager is not None and cfg.allocator == "native":  # torch's peak since entry, before exit
            torch_peak = torch.cuda.max_memory_allocated()
        before_exit()
        if cfg.cuda and manager is None:
            peak = torch.cuda.max_memory_allocated()
    timed = seconds[cfg.warmup:] or seconds
    median = statistics.median(timed)
    return {"losses": losses, "step_seconds": seconds, "tokens_per_second": cfg.tokens_per_step() / median,
            "median_step_seconds": median, "start_seconds": start_seconds,
            "cpu_seconds_per_micro_batch": statistics.median(timer.cpu[cfg.warmup * cfg.accum:] or timer.cpu),
            "device_seconds_per_micro_batch": statistics.median(timer.gpu[cfg.warmup * cfg.accum:] or timer.gpu),
            "peak_allocated_bytes": peak, "torch_peak_inside_bytes": torch_peak,
            # where the time went (the first step's above all): host seconds per micro-batch until it returned,
            # and per optimizer step with the device's work finished
            "micro_batch_wall_seconds": [round(w, 4) for w in timer.wall],
            "optimizer_step_seconds": [round(w, 4) for w in optimizer_seconds],
            **({"first_step_where": sampler.top()} if sampler is not None else {})}  # fmt: skip


def finish(out: dict[str, Any], model: Any, opt: Any) -> dict[str, Any]:
    out["params_sha256"] = digest(list(model.parameters()))
    out["state_sha256"] = digest(state_tensors(opt))
    return out


# -- the runs -------------------------------------------------------------------------------------------------
def run_plain(cfg: Config, found: dict[str, Any]) -> dict[str, Any]:
    model = cfg.build()
    if not cfg.fp32_masters:
        opt = adamw(list(model.parameters()))
        return finish(train(cfg, model, opt, opt.step), model, opt)
    import torch

    mp = MixedPrecision(model, cfg.device, torch.bfloat16)  # masters on the device (Note [Model state dtype])
    opt = adamw(mp.masters)

    def step() -> None:
        opt.step()
        mp.publish()

    out = train(cfg, model, opt, step, after_micro=mp.accumulate)
    out["params_sha256"], out["state_sha256"] = digest(mp.masters), digest(state_tensors(opt))
    return out


def manager(cfg: Config, model: Any, opt: Any, mode: str, budget: int) -> Any:
    import swap

    kw: dict[str, Any] = {}
    if cfg.fp32_masters:
        kw["compute_dtype"] = __import__("torch").bfloat16
    policy = swap.ModelStatePolicy(placement=mode, bucket_bytes=cfg.bucket)
    return swap.SwapManager(budget=budget, device=cfg.device, model=model, optimizer=opt, model_state=policy,
                            min_bytes=cfg.min_bytes, **kw)  # fmt: skip


# Note [A budget the model enters within]
# The manager takes the model on its device, as built (fp32 under --fp32-masters), and moves the weights to the
# host as it starts, making each entry's bf16 copy before letting its fp32 storage go (Note [The model as it
# enters] in swap/runtime/model_state/storage.py): the device's peak before the first iteration is the weights as
# built plus the first copy, and no plan can lower it. The 1B model in fp32 is 4.40 GB with a 131 MB first copy
# (the embedding), above the 4 GiB the size names: on an H200 every run reported a peak above the budget, a
# failure of the bench's choice, not of the training (which the plan held). So the default budget is at least
# that entry (plus 5 %, rounded up to 256 MiB): 4.5 GiB for the 1B model in fp32, its 4 GiB in bf16; still below
# its weights + AdamW state (13.2 GB), what the bench is about. The 200M model's 1 GiB was below what its training
# needs (the runtime's smallest budget: 1.20 GiB for AdamW, 1.29 GiB for SGD): every run was refused once and
# retried; 1.5 GiB fits both and stays below its weights + AdamW state (2.41 GB). A --budget given is used as is.
def entry_bytes(cfg: Config, model: Any) -> int:
    """The device's peak as the manager takes ``model`` (Note [A budget the model enters within]): its weights as
    built plus the largest parameter's compute copy (at least the first entry's)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    copy = max((p.numel() * (2 if cfg.fp32_masters else 0) for p in model.parameters()), default=0)
    return weights + copy


def budget_of(cfg: Config, model: Any) -> int:
    """The budget: given, or the size's raised to the model's entry (Note [A budget the model enters within]), or
    (tiny) 80 % of weights + AdamW state."""
    from swap.units import parse_size

    if cfg.budget_arg:
        return int(parse_size(cfg.budget_arg, "--budget"))
    if cfg.default_budget:
        step = 256 * MiB
        entry = -(-int(1.05 * entry_bytes(cfg, model)) // step) * step
        return max(cfg.default_budget, entry)
    return int(0.8 * 3 * sum(p.numel() * p.element_size() for p in model.parameters()))


# Note [A retry starts from nothing]
# A run refused its budget (InfeasibleBudget) is run again at 1.05x the smallest budget the refusal names. The
# refused attempt's manager exits by putting the model back on the device (its fp32 weights, and the fp32
# gradients of the micro-batch it ran), and the manager, the model and the optimizer hold one another in
# reference cycles: rebinding the names frees none of it until Python's cycle collector runs (on the CPU at
# tiny size: a retry needed 2.02 MB against the first attempt's 0.31 MB, and 0.31 MB with the collection). On an
# H200 the 200M model's retry counted 1.53 GiB it could not move, about the first attempt's fp32 weights and
# gradients (2 x 803 MB), and was refused at 2.69 GiB, though the first attempt had measured 1.20 GiB.
# The runtime now collects a refused run as the next manager starts (Note [Retrying after except
# InfeasibleBudget] in swap/runtime/machine/resources.py); the bench also drops its own names for the first
# attempt and empties torch's cache before the second is built.
def run_managed(cfg: Config, found: dict[str, Any], mode: str, make: Callable[..., Any] = adamw,
                before_exit: Callable[[Any], None] = lambda opt: None) -> dict[str, Any]:  # fmt: skip
    import gc

    import torch

    import swap

    model = cfg.build()
    budget = budget_of(cfg, model)
    out: dict[str, Any] = {"budget_bytes": budget}
    opt: Any = None
    sm: Any = None
    for attempt in range(2):
        if attempt:  # Note [A retry starts from nothing]
            model = opt = sm = None
            gc.collect()
            if cfg.cuda:
                torch.cuda.empty_cache()
            model = cfg.build()
        opt = make(list(model.parameters()))
        sm = manager(cfg, model, opt, mode, budget)
        try:
            grads0 = first_grads(lambda m=model, s=sm: managed_grads(s, m), out)
            out.update(train(cfg, model, opt, opt.step, sm, after_backward=grads0,
                             before_exit=lambda o=opt: before_exit(o)))  # fmt: skip
            break
        except swap.InfeasibleBudget as e:
            if attempt:
                raise
            out["infeasible_at"] = budget
            budget = out["budget_bytes"] = int(1.05 * e.min_budget)
    rep = sm.report()
    ms = dict(rep.get("model_state") or {})
    ms.pop("bucket_specs", None)
    out["report"] = {k: rep.get(k) for k in ("status", "peak_device_bytes", "entry_peak_bytes", "planned_peak_bytes",
                                             "budget_bytes", "overruns", "swapped_out_bytes", "demand_fetches",
                                             "stall_seconds", "replans", "memory_source")}  # fmt: skip
    out["notes"] = [n for n in rep.get("notes", []) if "budget" in n]  # a budget not held is said out loud
    out["model_state"] = ms
    out["within_budget"] = rep.get("peak_device_bytes") is not None and rep["peak_device_bytes"] <= budget
    out["weights_and_adamw_state_bytes"] = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    out["pinned_bytes"], out["pinned_bytes_predicted"] = ms.get("pinned_bytes"), ms.get("pinned_bytes_predicted")
    out["bytes_per_kind"] = {k: ms.get(k) for k in ("weights_in_bytes", "weights_out_bytes", "grads_out_bytes",
                                                     "state_in_bytes", "activations_in_bytes",
                                                     "activations_out_bytes")}  # fmt: skip
    out["host_kernel"] = ms.get("host_kernel")
    # What strategy="auto" chose: recompute regions rerun their weights' reads in the backward (Note [Reads of
    # weights in flight] in swap/runtime/model_state/guard.py), and which it chose depends on the run's timings.
    jv = sm.joint_view
    out["joint"] = {"regions": {p: {"calls": r.calls, "reruns": r.reruns} for p, r in jv.regions.items()},
                    "rebuilding": jv.rebuilding, "rebuilt": jv.rebuilt}  # fmt: skip
    seconds, exposed = ms.get("host_step_seconds"), ms.get("host_step_exposed_seconds")
    if seconds is not None and exposed is not None:
        out["host_step"] = {"seconds": seconds, "exposed_seconds": exposed,
                            "hidden_seconds": max(0.0, seconds - exposed)}  # fmt: skip
    return finish(out, model, opt)


def host_kernel_flags(kernel: Optional[str]) -> dict[str, Any]:
    """torch's AdamW flags for the kernel the runtime's host step named (Note [The host kernel])."""
    return {"fused": {"fused": True}, "foreach": {"foreach": True}}.get(kernel or "for-loop", {"foreach": False})


def run_reference(cfg: Config, found: dict[str, Any], make: Callable[..., Any] = adamw,
                  kernel: Optional[str] = None) -> dict[str, Any]:  # fmt: skip
    """The oracle: device forward and backward; torch's AdamW over host copies; parameters copied back."""
    import torch

    model = cfg.build()
    kernel = kernel or (found.get("ours") or {}).get("host_kernel")
    if cfg.fp32_masters:  # bf16 gradients accumulated in fp32 on the host after each backward
        mp = MixedPrecision(model, "cpu", torch.bfloat16)
        masters, after_micro, gather = mp.masters, mp.accumulate, lambda: None
    else:  # the device accumulates the micro-batches' gradients; the step copies them to the host
        params = list(model.parameters())
        masters = [p.detach().to("cpu", copy=True) for p in params]
        after_micro = lambda: None  # noqa: E731

        def gather() -> None:
            for p, m in zip(params, masters):
                m.grad = p.grad.to("cpu", copy=True)
                p.grad = None  # the loop's zero_grad clears the host optimizer's gradients, not the model's

    host_opt = make(masters, **host_kernel_flags(kernel))

    def step() -> None:
        gather()
        host_opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)

    found_grads: dict[str, Any] = {}
    grads0 = first_grads(lambda: [m.grad for m in masters] if cfg.fp32_masters else
                         [p.grad for p in model.parameters()], found_grads)  # fmt: skip
    out = train(cfg, model, host_opt, step, after_micro=after_micro, after_backward=grads0)
    out.update(found_grads)
    out["host_kernel"] = kernel or "for-loop"
    out["params_sha256"] = digest(masters)
    out["state_sha256"] = digest(state_tensors(host_opt))
    return out


# Note [The first step's gradients]
# Losses equal through the first step and different after it say the first update differs, not whether its
# gradients (the backward, the copies off the device, the fp32 accumulation) or the host step did. So ours and the
# oracle digest the gradients the first optimizer step is about to read: the fp32 ones accumulated over its
# micro-batches (the host buffers' for ours, read without touching the speculation's counters; the masters' for
# the oracle), or the parameters' own without --fp32-masters.
def first_grads(grads: Callable[[], list[Any]], into: dict[str, Any]) -> Callable[[], None]:
    """An ``after_backward`` for ``train`` putting the digest of ``grads()`` at the first step into
    ``into["step0_grads_sha256"]`` (Note [The first step's gradients])."""

    def after_backward() -> None:
        if "step0_grads_sha256" not in into:
            import torch

            into["step0_grads_sha256"] = digest([g if g is not None else torch.zeros(0) for g in grads()])

    return after_backward


def managed_grads(sm: Any, model: Any) -> list[Any]:
    """The managed run's gradients as its optimizer step reads them: host buffers for offloaded parameters, once
    every copy and accumulation landed, the device's for the others."""
    ms = sm.model_state
    ms.grads.settle()
    with ms.grads.raw():
        return [ms.grads.grad(p) if ms.grads.manages(p) else p.grad for p in model.parameters()]


def run_cpu_offload(cfg: Config, found: dict[str, Any]) -> dict[str, Any]:
    from bench.gpu.cpu_offload import CPUOffloadAdamW

    model = cfg.build()
    opt = CPUOffloadAdamW(model, adamw)
    try:
        out = train(cfg, model, opt, opt.step)
    finally:
        opt.close()
    out["params_sha256"] = digest(list(model.parameters()))
    out["state_sha256"] = digest(state_tensors(opt))
    return out


def sgd(params: list[Any], **kw: Any) -> Any:
    """Stateless SGD (no momentum): nothing to copy back at exit but the weights."""
    import torch

    return torch.optim.SGD(params, lr=100 * LR, momentum=0.0, **kw)


def run_sgd_exit(cfg: Config, found: dict[str, Any]) -> dict[str, Any]:
    """Row 6 of ../shared/notes/model-state-review.md: at exit the weights are copied back from the host masters
    while the host pools close; with stateless SGD and the gradients dropped before exit, no later synchronous
    copy closes that window. Ours (offload, SGD, ``zero_grad(set_to_none=True)`` before exit) against the same
    training with SGD on host copies: the final parameters bitwise, late copies making any race show."""
    ours = run_managed(cfg, found, "streamed", sgd, lambda opt: opt.zero_grad(set_to_none=True))
    if "error" in ours:
        return ours
    ref = run_reference(cfg, found, sgd, ours.get("host_kernel"))
    same = {k: ours.get(k) == ref.get(k) for k in ("losses", "params_sha256")}
    return {"bitwise": same, "ours": {k: ours.get(k) for k in ("losses", "params_sha256", "host_kernel", "report",
                                                                 "within_budget")},
            "reference": {k: ref.get(k) for k in ("losses", "params_sha256")}}  # fmt: skip


RUNNERS: dict[str, Callable[[Config, dict[str, Any]], dict[str, Any]]] = {
    "plain": run_plain, "ours": lambda c, f: run_managed(c, f, "streamed"), "reference": run_reference,
    "auto": lambda c, f: run_managed(c, f, "auto"), "cpu_offload": run_cpu_offload, "sgd_exit": run_sgd_exit,
}  # fmt: skip


def compare(found: dict[str, Any]) -> dict[str, Any]:
    """Bitwise checks and ratios from the runs found so far."""
    out: dict[str, Any] = {}
    ref, ours = found.get("reference"), found.get("ours")
    if ref and ours and "losses" in ref and "losses" in ours:
        out["ours_vs_reference_bitwise"] = {k: ref[k] == ours[k] for k in ("losses", "params_sha256", "state_sha256")}
        if "step0_grads_sha256" in ref and "step0_grads_sha256" in ours:  # Note [The first step's gradients]
            out["ours_vs_reference_bitwise"]["step0_grads"] = ref["step0_grads_sha256"] == ours["step0_grads_sha256"]
    if ref and found.get("plain") and "losses" in found["plain"]:
        n = found["plain"]["losses"][:1]
        out["determinism_precheck_step0_loss_equal"] = n == ref["losses"][:1]
    if ref and found.get("cpu_offload") and "losses" in found["cpu_offload"]:
        co = found["cpu_offload"]
        out["cpu_offload_vs_reference_bitwise"] = {k: ref[k] == co[k] for k in ("losses", "params_sha256")}
    if found.get("sgd_exit") and "bitwise" in found["sgd_exit"]:
        out["sgd_exit_bitwise"] = found["sgd_exit"]["bitwise"]
    if ref and found.get("auto") and "losses" in found["auto"]:
        out["auto_max_abs_loss_difference"] = max(abs(float(a) - float(b)) for a, b in
                                                  zip(ref["losses"], found["auto"]["losses"]))  # fmt: skip
    rate = {k: v["tokens_per_second"] for k, v in found.items() if isinstance(v, dict) and "tokens_per_second" in v}
    for k in ("plain", "cpu_offload", "reference"):
        if k in rate:
            out[f"tokens_per_second_vs_{k}"] = {n: r / rate[k] for n, r in rate.items() if n != k}
    return out


def verdict(result: dict[str, Any]) -> tuple[bool, str]:
    """One line for the lease's summary, and whether the run passed (ours bitwise, within the budget)."""
    found, cmp = result["runs"], result["compare"]
    bits = cmp.get("ours_vs_reference_bitwise")
    ours = found.get("ours", {})
    parts = []
    if bits is not None:
        parts.append("ours bitwise vs oracle: " + ("yes" if all(bits.values()) else
                                                    "NO (" + ", ".join(k for k, v in bits.items() if not v) + ")"))
    if "tokens_per_second" in ours:
        parts.append(f"ours {ours['tokens_per_second']:.0f} tok/s")
    for k in ("plain", "cpu_offload"):
        r = cmp.get(f"tokens_per_second_vs_{k}", {}).get("ours")
        if r is not None:
            parts.append(f"{r:.2f}x {k}")
    if "within_budget" in ours:
        parts.append(f"within budget: {ours['within_budget']}")
    if "host_step" in ours:
        parts.append(f"host step {ours['host_step']['seconds']:.2f} s ({ours['host_step']['exposed_seconds']:.2f} s "
                     "exposed)")
    parts.append(result["compute_dtype"])
    exit_bits = cmp.get("sgd_exit_bitwise")
    if exit_bits is not None:
        parts.append("SGD weights back at exit bitwise: " + ("yes" if all(exit_bits.values()) else "NO"))
    errors = [f"{k}: {v['error']}" for k, v in found.items() if isinstance(v, dict) and "error" in v]
    parts += errors
    ok = bool(bits) and all(bits.values()) and bool(ours.get("within_budget")) and not errors
    ok = ok and (exit_bits is None or all(exit_bits.values()))
    return ok, "; ".join(parts) or "no run finished"


def parser() -> argparse.ArgumentParser:
    """The command line (the lease checks its own commands against it on the CPU)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget", help="the manager's budget (default: the size's; tiny: 80%% of weights + state)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--accum", type=int, help="micro-batches a step (default: the size's)")
    p.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, choices=RUNS)
    p.add_argument("--lag", action="store_true", help="delay every copy of the swap engine (CUDA only)")
    p.add_argument("--allocator", choices=["native", "vmalloc"], default="native")
    p.add_argument("--fp32-masters", action="store_true", help="fp32 model, bf16 compute_dtype (if the runtime has it)")
    p.add_argument("--out", type=Path, default=Path("build/lease"))
    p.add_argument("--name", default="model_state_gpu")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    import swap

    if args.device.startswith("cuda"):
        common.require_gpu()
    if args.fp32_masters and "compute_dtype" not in inspect.signature(swap.SwapManager).parameters:
        p.error("--fp32-masters needs SwapManager(compute_dtype=), which this runtime does not have")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    cfg = Config(args)
    notes = []
    if cfg.cuda and args.allocator == "vmalloc":
        import vmalloc

        torch.cuda.memory.change_current_allocator(vmalloc.allocator())
    lag = "off"
    if args.lag:
        if cfg.cuda:
            from bench.gpu import lag as lagging

            lagging.install()
            lag = f"{lagging.DEFAULT_CYCLES} cycles before every copy"
        else:
            lag = "skipped: no CUDA (the CPU engine has no copy streams to delay)"
    has_compute_dtype = "compute_dtype" in inspect.signature(swap.SwapManager).parameters
    compute = ("bf16 compute, fp32 masters and state (compute_dtype)" if cfg.fp32_masters else
               "bf16 parameters, bf16 AdamW state: " + ("--fp32-masters not asked" if has_compute_dtype else
                                                         "the runtime has no compute_dtype (Note [Model state dtype])"))
    if cfg.fp32_masters and "cpu_offload" in args.runs:
        notes.append("cpu_offload keeps torchao's schedule, parameters resident in the model's dtype: with "
                     "--fp32-masters it computes in fp32, not bf16 (Note [Model state dtype])")
    result: dict[str, Any] = {
        "environment": common.environment(), "size": cfg.size, "shape": dict(zip(
            ("layers", "d_model", "heads", "kv_heads", "d_ff", "vocab"), cfg.shape)),
        "seq": cfg.seq, "micro_batches": cfg.accum, "steps": cfg.steps, "warmup": cfg.warmup,
        "device": str(cfg.device), "allocator": args.allocator, "lag": lag, "compute_dtype": compute,
        "runs": {}, "compare": {}, "notes": notes,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    order = list(dict.fromkeys(args.runs))  # as given: the lease puts the bitwise pair first
    if "reference" in order and "ours" in order:  # the oracle takes the host kernel ours reported
        order.remove("reference")
        order.insert(order.index("ours") + 1, "reference")
    for name in order:
        print(f"model_state_gpu: {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            row = RUNNERS[name](cfg, result["runs"])
        except Exception as e:  # noqa: BLE001 - one run failing must not lose the others
            import traceback

            traceback.print_exc()
            row = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        row["wall_seconds"] = round(time.perf_counter() - t0, 2)
        result["runs"][name] = row
        result["compare"] = compare(result["runs"])
        result["ok"], result["figure"] = verdict(result)
        path.write_text(json.dumps(result, indent=1, default=str) + "\n")
        shown = row.get("error") or (f"{row['tokens_per_second']:.0f} tok/s" if "tokens_per_second" in row else "done")
        print(f"model_state_gpu: {name}: {shown} ({row['wall_seconds']:.0f} s)", flush=True)
        import gc

        gc.collect()
        if cfg.cuda:
            torch.cuda.empty_cache()
    print(f"model_state_gpu: {'PASS' if result['ok'] else 'FAIL'}: {result['figure']}; wrote {path}", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
