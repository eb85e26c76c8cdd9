"""What a GPU lease measured beside what the forecast says for the same run, with the error.

    python -m bench.gpu_vs_forecast                         # ~5 minutes on 2 shared cores, no GPU
    python -m bench.gpu_vs_forecast --lease DIR --out DIR   # another lease's results

Reads the lease's result files (default: bench/results/gpu/NVIDIA_H200/lease-2026-11-28/): ``alloc_ratio.json``
(bench/gpu/alloc_ratio.py), ``model_state_gpu.json`` (bench/gpu/model_state_gpu.py) and ``swap_lag.json``
(tests/gpu/swap_worker.py under the lease's late-copies phase). For each measured figure the forecast has a
counterpart for, it runs the forecast on the CPU (``swap.plan``, ``swap.forecast.predict_peak``, the allocator
replay ``swap.forecast.replay.measure``; device profile ``h200``) with the model, batch, dtype, optimizer and
budget of the run, and tabulates measured (on the GPU, read from the file), forecast (simulated here) and the
error, forecast / measured - 1. Every row names the file and key it read and the call that forecast it, and says
what differs between the two where the forecast cannot price the run as it ran (Note [Nearest configuration]).

- GPT-2 (``zoo.gpt2``, seq 1024, batch 4) and ResNet-50 (batch 96, 224 px), fp32, SGD with momentum, TF32 on for
  matmuls and convolutions (as alloc_ratio.py sets it: ``tf32="on"``), no swapping: peak allocated and reserved
  per allocator (native, expandable segments, vmalloc) against the captured trace replayed on the models of those
  allocators; step time against ``swap.plan(policies=("none",))``.
- The Llama-shaped 1B (``zoo.llama(22, 2048, 32, 4, 5632, 32000)``, seq 2048, micro-batches of one sequence, 4 a
  step, AdamW with two param groups): ``plain`` (everything on the device) and ``ours`` (``SwapManager`` with
  ``ModelStatePolicy(placement="streamed", bucket_bytes="32MiB")``, budget 4 GiB, ``compute_dtype=torch.bfloat16``)
  against ``swap.plan`` without and with ``model_state=`` (host profile ``server-ddr5-8ch``): ``ours`` in the run's
  format (``ModelStatePolicy(compute_dtype=torch.bfloat16)``), ``plain`` twice, an fp32 model and a bf16 model, the
  two configurations nearest the run's (fp32 masters and AdamW state, bf16 compute), neither of them the run's.
  The runtime's own predictions (``host_bytes_predicted`` etc., in the run's file) are listed apart: they are the
  runtime's ledger for the run as it ran, not a forecast.
- The swapped ResNet (tests/gpu/swap_worker.py's ``resnet``: ``zoo.resnet((2, 2, 2, 2), width=32,
  num_classes=10)``, batch 32, 96 px, window policy, ``min_bytes="256KiB"``, budget 60 % of its unswapped peak):
  the unswapped peak and the swapped peak against ``predict_peak`` under the same budget, and the swapped run's
  reserved bytes against its swapped trace (``swap.forecast.from_trace.swapped``) replayed on the native model.

Writes <out>/vs_forecast.json and vs_forecast.md (default <out>: the lease folder).

Note [Nearest configuration]
The 1B run trains an fp32 model with ``compute_dtype=torch.bfloat16`` (``ours``, ``auto``) or by hand in the same
format (``plain``: bench/gpu/mixed_precision.py): fp32 masters, gradients and AdamW state, bf16 compute copies on
the device. The model-state forecast prices that as the runtime runs it (``ModelStatePolicy(compute_dtype=
torch.bfloat16)``: Note [Mixed precision pricing] in swap/forecast/offload.py), so ``ours`` is forecast in the run's
format. The plain forecast cannot (its capture trains a model in one dtype, and mixed precision keeps the masters
on the host, which a plain run does not): so ``plain`` is forecast twice, in the two formats it lies between, and
each row says which: ``fp32`` (``dtype=None``: fp32
weights, gradients, masters and state, fp32 compute with matmuls in IEEE fp32 as the run's flags left them) has the
run's master, gradient and state bytes but computes and saves activations in fp32, and streams fp32 weights (4
bytes a parameter, not 2); ``bf16`` (``dtype=torch.bfloat16``: pure bf16, the capture's AdamW state in bf16 too)
computes as the run does but keeps half the run's model-state bytes. Other differences, in both: the forecast's
step is one micro-batch and one optimizer step, the run's four micro-batches and one; rows marked "derived"
compose the forecast's own figures to four (the formula is in the row). The forecast's host steps are
speculative during the backward where the runtime's rollback copies fit the host (Note [What the runtime runs] in
swap/forecast/offload.py: on this host they do), as the run's were; its host bytes count those copies, the run's
``host_bytes`` does not (its ``speculation.rollback_bytes_peak`` does), so the row compares the plan's less them.
The host is the built-in ``server-ddr5-8ch`` profile (8 channels of DDR5, AdamW at 211 GB/s of DRAM traffic): the
lease's 16-CPU host was never profiled (bench/host_profile.py did not run there).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

import swap
from bench.gpu import alloc_ratio, model_state_gpu
from bench.write import write_results
from swap.capture import capture
from swap.devices import profile as device_profile
from swap.forecast import zoo
from swap.forecast.from_trace import sequence_from_trace, swapped
from swap.forecast.predict import predict_peak
from swap.forecast.replay import measure
from swap.schedule.model_state import Placement
from swap.schedule.model_state.ledger import rollback_bytes
from swap.schedule.simulator import schedule_for
from swap.units import parse_size

ROOT = Path(__file__).resolve().parents[1]
LEASE = ROOT / "bench" / "results" / "gpu" / "NVIDIA_H200" / "lease-2026-11-28"
DEVICE = "h200"
HOST = "server-ddr5-8ch"
GiB = 1 << 30
# alloc_ratio.py's allocators -> the replay's models of them (swap/forecast/replay)
REPLAYED = {"native": "pytorch_native", "expandable": "pytorch_expandable", "vmalloc": "vmalloc"}
ONE_B = model_state_gpu.SIZES["1b"]  # shape (layers, d_model, heads, kv heads, d_ff, vocab), seq, accum, budget
LLAMA_1B, SEQ_1B, ACCUM_1B = ONE_B["shape"], ONE_B["seq"], ONE_B["accum"]
# tests/gpu/swap_worker.py's MODELS["resnet"] (batch, image side) and its SwapManager's policy and min_bytes;
# tests/bench/test_gpu_vs_forecast.py holds them to the worker's
LAG_MODEL = {"batch": 32, "size": 96, "min_bytes": "256KiB", "policy": "window", "lr": 0.05}


# -- the runs' models, batches, losses and optimizers, as the lease's scripts make them -------------------------
def sgd_momentum(lr: float) -> Callable[[Any], torch.optim.Optimizer]:
    def make(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=0.9)

    return make


def adamw_two_groups(params: Any) -> torch.optim.Optimizer:
    """bench/gpu/model_state_gpu.py's ``adamw``: no weight decay on parameters of fewer than two dimensions."""
    return model_state_gpu.adamw(list(params))


def llama_1b() -> torch.nn.Module:
    return zoo.llama(*LLAMA_1B)


def llama_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, LLAMA_1B[5], (n, SEQ_1B + 1))
    return t[:, :-1], t[:, 1:]


def llama_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """model_state_gpu.py's micro-batch: full logits, upcast, cross-entropy, divided by the micro-batches a step."""
    x, y = batch
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) / ACCUM_1B


def lag_resnet() -> torch.nn.Module:
    return zoo.resnet((2, 2, 2, 2), width=32, num_classes=10)


def lag_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, LAG_MODEL["size"], LAG_MODEL["size"]), torch.randint(0, 10, (n,))


# -- sections and rows ------------------------------------------------------------------------------------
def section(title: str, short: str, measured_from: str, forecast_by: str, differs: str) -> dict[str, Any]:
    """A group of rows that share one measured file, one forecast call and what differs between the two;
    ``short``: its name in the summary."""
    return {"title": title, "short": short, "measured_from": measured_from, "forecast_by": forecast_by,
            "differs": differs, "rows": []}  # fmt: skip


def row(sec: dict[str, Any], figure: str, measured: Optional[float], forecast: Optional[float], unit: str,
        measured_key: str, forecast_key: str, note: str = "", kind: str = "simulated",
        headline: bool = False) -> None:  # fmt: skip
    """One figure of ``sec``: measured on the GPU (``measured_key`` of the section's file) and forecast
    (``forecast_key`` of the section's call; ``kind``: "simulated", "derived" from simulated figures by the formula
    in ``forecast_key``, or "runtime": the runtime's own prediction, read from the run's file). ``headline``: also
    in the summary table."""
    error = forecast / measured - 1 if measured and forecast is not None else None
    sec["rows"].append({"figure": figure, "unit": unit, "measured": measured, "forecast": forecast, "error": error,
                        "kind": kind, "measured_key": measured_key, "forecast_key": forecast_key, "note": note,
                        "headline": headline})  # fmt: skip


def no_swap(alloc: dict[str, Any]) -> list[dict[str, Any]]:
    """GPT-2 b4 and ResNet-50 b96 without swapping: peaks per allocator and step time."""
    out = []
    h200 = device_profile(DEVICE)
    for model, batch in alloc_ratio.BATCH.items():
        runs = {r["allocator"]: r for r in alloc["rows"] if r["model"] == model and "throughput" in r}
        w = zoo.ZOO[model]
        t0 = time.perf_counter()
        plan = swap.plan(w.model_fn(), w.batch_fn(), budget=h200.memory, device=DEVICE, allocator="pytorch_native",
                         max_batch=batch, optimizer=w.optimizer, policies=("none",), strategies=(), tf32="on",
                         progress=False)  # fmt: skip
        r = plan.policies["none"]
        assert r.max_batch == batch, f"{model}: batch {batch} does not fit the device in the forecast"
        trace = capture(w.model_fn(), w.batch_fn(), batch, optimizer=w.optimizer, name=model)
        replays = {a: measure(trace, REPLAYED[a]) for a in REPLAYED}
        print(f"gpu_vs_forecast: {model} b{batch}: forecast in {time.perf_counter() - t0:.0f} s", flush=True)
        differs = ("fp32, SGD with momentum, TF32 on for matmuls and convolutions in both. The run holds 2 batches "
                   "on the device, the capture 1" + (" (+55 MiB); the run's ResNet-50 is torchvision's where it "
                   "imports on the lease host (not recorded), the forecast's is swap.forecast.zoo's" if
                   model == "resnet50" else " (+64 KiB)") + ".")  # fmt: skip
        sec = section(f"{model} b{batch}, no swapping", f"{model} b{batch}", f"alloc_ratio.json, rows of model {model}",
                      f"`swap.plan(zoo {model}, budget=<the h200's memory>, device='h200', max_batch={batch}, "
                      f"policies=('none',), strategies=(), tf32='on', allocator='pytorch_native')`; replays: the "
                      f"same step captured (`swap.capture`, batch {batch}, 2 steps) and replayed on the models of "
                      "the allocators (`swap.forecast.replay.measure`)", differs)  # fmt: skip
        nat = runs["native"]
        row(sec, "peak allocated (native), the plan", nat["peak_allocated_bytes"], r.peak, "bytes",
            "native: peak_allocated_bytes", "policies['none'].peak", headline=True)
        for a in REPLAYED:
            if a not in runs:
                continue
            row(sec, f"peak allocated ({a})", runs[a]["peak_allocated_bytes"], replays[a]["peak_allocated"], "bytes",
                f"{a}: peak_allocated_bytes", f"replay on {REPLAYED[a]}: peak_allocated")
            row(sec, f"peak reserved ({a})", runs[a]["peak_reserved_bytes"], replays[a]["peak_reserved"], "bytes",
                f"{a}: peak_reserved_bytes", f"replay on {REPLAYED[a]}: peak_reserved")
        row(sec, "step, device seconds (native)", nat["device_seconds_per_iteration"], r.step_time, "s",
            "native: device_seconds_per_iteration (median of 20, CUDA events)", "policies['none'].step_time",
            headline=True)
        row(sec, "step, wall seconds (native)", nat["wall_seconds_per_iteration"], r.step_time, "s",
            "native: wall_seconds_per_iteration (20 iterations over their wall time)", "policies['none'].step_time")
        out.append(sec)
    return out


RUN_FORMAT = ("The run: an fp32 model trained with bf16 compute copies on the device and fp32 masters, gradients "
              "and AdamW state (18 B a parameter on the device when plain), bf16 activations, 4 micro-batches of "
              "one sequence a step. ")  # fmt: skip
ARTICLE = {"fp32": "an", "bf16": "a"}
MIXED = "mixed"  # ours forecast in the run's format (Note [Nearest configuration])
FORECAST_FORMAT = {
    "fp32": "The forecast: an fp32 model (`dtype=None`): every role fp32 (16 B a parameter), fp32 compute and "
            "activations, matmuls in IEEE fp32 as the run's flags left them (`tf32='off'`; the model has no "
            "convolutions).",
    "bf16": "The forecast: a bf16 model (`dtype=torch.bfloat16`): every role bf16, the AdamW state too (8 B a "
            "parameter), bf16 compute and activations.",
    MIXED: "The forecast: the run's format (`ModelStatePolicy(compute_dtype=torch.bfloat16)`, an fp32 model: Note "
           "[Mixed precision pricing] in swap/forecast/offload.py): bf16 compute copies and activations on the "
           "device, bf16 weights in and gradients out, fp32 masters, gradients and AdamW state on the host, the bf16 "
           "copies and the accumulation buffer pinned.",
}  # fmt: skip


def plain_1b(ms: dict[str, Any], dtype_name: str) -> dict[str, Any]:
    """The 1B trained plain: peak (one micro-batch's activations) and step time (4 micro-batches)."""
    dtype = torch.bfloat16 if dtype_name == "bf16" else None
    plain = ms["runs"]["plain"]
    h200 = device_profile(DEVICE)
    found = {}
    for n in (1, ACCUM_1B):
        t0 = time.perf_counter()
        p = swap.plan(llama_1b, llama_batch, llama_loss, budget=h200.memory, device=DEVICE, allocator="pytorch_native",
                      max_batch=n, optimizer=adamw_two_groups, dtype=dtype, policies=("none",), strategies=(),
                      tf32="off", progress=False)  # fmt: skip
        found[n] = p.policies["none"]
        assert found[n].max_batch == n, f"1B {dtype_name}: batch {n} does not fit the device in the forecast"
        print(f"gpu_vs_forecast: 1B plain {dtype_name} batch {n}: forecast in {time.perf_counter() - t0:.0f} s",
              flush=True)  # fmt: skip
    sec = section(f"1B plain, forecast as {ARTICLE[dtype_name]} {dtype_name} model",
                  f"1B plain ({dtype_name} forecast)", "model_state_gpu.json, runs.plain",
                  f"`swap.plan(zoo llama 1B, loss as the run's, AdamW in two groups, dtype="
                  f"{'torch.bfloat16' if dtype else 'None'}, budget=<the h200's memory>, device='h200', "
                  "policies=('none',), strategies=(), tf32='off', max_batch=N)` at N = 1 and N = 4",
                  RUN_FORMAT + FORECAST_FORMAT[dtype_name] + " Its step at batch 4 is one batch of 4 sequences and "
                  "one optimizer step: the run's tokens and optimizer steps, not its micro-batches.")  # fmt: skip
    s1, s4 = found[1].step_time, found[ACCUM_1B].step_time
    row(sec, "peak allocated", plain["peak_allocated_bytes"], found[1].peak, "bytes",
        "peak_allocated_bytes (steps 2-3)", "policies['none'].peak at N = 1 (one micro-batch's activations)",
        headline=True)
    row(sec, "step (4 micro-batches + AdamW)", plain["median_step_seconds"], s4, "s", "median_step_seconds",
        "policies['none'].step_time at N = 4", headline=True)
    row(sec, "one micro-batch, forward + backward", plain["device_seconds_per_micro_batch"], (s4 - s1) / 3, "s",
        "device_seconds_per_micro_batch (median, CUDA events)", "(step_time at N = 4 - at N = 1) / 3",
        kind="derived")
    return sec


def timed_steps(ms_run: dict[str, Any], warmup: int) -> list[dict[str, Any]]:
    steps = ms_run["model_state"]["steps"]
    return steps[warmup:] or steps


def model_state_1b(ms: dict[str, Any], dtype_name: str) -> dict[str, Any]:
    """The 1B under SwapManager(model state streamed, budget 4 GiB) against swap.plan's model-state forecast
    (``dtype_name`` MIXED: in the run's format)."""
    dtype = torch.bfloat16 if dtype_name == "bf16" else None
    compute = torch.bfloat16 if dtype_name == MIXED else None
    ours = ms["runs"]["ours"]
    budget = ours["budget_bytes"]
    t0 = time.perf_counter()
    p = swap.plan(llama_1b, llama_batch, llama_loss, budget=budget, device=DEVICE, allocator="pytorch_native",
                  max_batch=1, optimizer=adamw_two_groups, dtype=dtype, policies=("none",), strategies=(), tf32="off",
                  batch=1, host=HOST, model_state=swap.ModelStatePolicy(placement="streamed", bucket_bytes="32MiB",
                                                                        compute_dtype=compute),
                  progress=False)  # fmt: skip
    print(f"gpu_vs_forecast: 1B model state {dtype_name}: forecast in {time.perf_counter() - t0:.0f} s", flush=True)
    f = p.model_state.results["ours"]
    assert f.fits and f.sim is not None and f.plan is not None, f"1B {dtype_name}: {f.why}"
    sim, dtype_arg = f.sim, "torch.bfloat16" if dtype else "None"
    as_ = "in the run's format" if compute else f"as {ARTICLE[dtype_name]} {dtype_name} model"
    policy_arg = ", compute_dtype=torch.bfloat16" if compute else ""
    priced = ("" if compute else " `swap.plan` refused `ModelStatePolicy(compute_dtype=...)` then, so the run's "
              "format was not priced.")  # fmt: skip
    sec = section(
        f"1B model state streamed, budget {budget / GiB:.0f} GiB, forecast {as_}",
        f"1B model state ({dtype_name} forecast)",
        "model_state_gpu.json, runs.ours (`ModelStatePolicy(placement='streamed', bucket_bytes='32MiB')`, "
        "`compute_dtype=torch.bfloat16`, strategy auto); per step: the median of the steps after the first",
        f"`swap.plan(zoo llama 1B, loss as the run's, AdamW in two groups, dtype={dtype_arg}, budget={budget}, "
        f"device='h200', batch=1, host='{HOST}', model_state=ModelStatePolicy("
        f"placement='streamed', bucket_bytes='32MiB'{policy_arg}), tf32='off').model_state.results['ours']`",
        RUN_FORMAT + "Its host keeps fp32 masters, gradients and state and pinned bf16 copies, which stream in. "
        + FORECAST_FORMAT[dtype_name] + priced + " The forecast's step is one micro-batch and one host step (rows "
        "\"derived\" "
        f"compose it to {ACCUM_1B}); its host steps are speculative during the backward where the rollback copies "
        f"fit (timing: {f.timing}), as the run's were; its host is the built-in `{HOST}` profile (AdamW at 211 "
        "GB/s of DRAM traffic): the lease's 16-CPU host was never profiled.",
    )  # fmt: skip
    steps = timed_steps(ours, ms["warmup"])
    exposed = sim.host_exposed
    micro = f.step_time - exposed
    moved = sim.bytes_by_kind

    def med(key: str) -> float:
        return statistics.median(s[key] for s in steps)

    row(sec, "step (4 micro-batches + host step)", ours["median_step_seconds"], ACCUM_1B * micro + exposed, "s",
        "median_step_seconds", f"{ACCUM_1B} x (step_time - host_exposed) + host_exposed", kind="derived",
        headline=True)
    row(sec, "one micro-batch, forward + backward", ours["device_seconds_per_micro_batch"], micro, "s",
        "device_seconds_per_micro_batch (median, CUDA events)", "step_time - host_exposed", kind="derived")
    row(sec, "host step a step", med("host_step_seconds"), sim.host_seconds, "s",
        "model_state.steps: host_step_seconds", "sim.host_seconds")
    row(sec, "host step exposed a step", med("host_step_exposed_seconds"), exposed, "s",
        "model_state.steps: host_step_exposed_seconds", "sim.host_exposed")
    row(sec, "device peak", ours["report"]["peak_device_bytes"], f.device_peak, "bytes",
        "report.peak_device_bytes (the runtime's meter)", "device_peak (planned)",
        f"budget {fmt_value(budget, 'bytes')}", headline=True)
    copies = rollback_bytes((b.master_bytes, b.state_bytes) for b, p in zip(f.buckets, f.plan.placements)
                            if p != Placement.RESIDENT and f.plan.speculate)  # fmt: skip
    row(sec, "host bytes (model state)", ours["model_state"]["host_bytes"], f.plan.host_bytes - copies, "bytes",
        "model_state.host_bytes", "plan.host_bytes less its rollback copies (model state; swapped activations "
        "apart)", headline=True)  # fmt: skip
    row(sec, "pinned bytes", ours["pinned_bytes"], f.plan.pinned_bytes, "bytes", "pinned_bytes",
        "plan.pinned_bytes", "pinned in both: the bf16 copies and the accumulation buffer" if compute else
        "pinned in the run: the bf16 copies and the accumulation buffer; in the forecast: masters, gradients and the "
        "accumulation buffer (not mixed precision)", headline=True)  # fmt: skip
    row(sec, "weights in a step", med("weights_in_bytes"), ACCUM_1B * moved.get("weights", (0, 0))[0], "bytes",
        "model_state.steps: weights_in_bytes", f"{ACCUM_1B} x sim.bytes_by_kind['weights'][0]", kind="derived")
    row(sec, "gradients out a step", med("grads_out_bytes"), ACCUM_1B * moved.get("gradients", (0, 0))[1], "bytes",
        "model_state.steps: grads_out_bytes", f"{ACCUM_1B} x sim.bytes_by_kind['gradients'][1]", kind="derived")
    row(sec, "activations out a step", med("activations_out_bytes"), ACCUM_1B * moved.get("activations", (0, 0))[1],
        "bytes", "model_state.steps: activations_out_bytes", f"{ACCUM_1B} x sim.bytes_by_kind['activations'][1]",
        f"the forecast's activation plan: {f.activations}", kind="derived")
    return sec


def runtime_own(ms: dict[str, Any]) -> dict[str, Any]:
    """The runtime's predictions for the 1B run, as it ran (its ledger and its plan), against what it measured."""
    sec = section("1B model state, the runtime's own predictions (not the forecast)", "1B model state (the runtime's "
                  "own prediction)", "model_state_gpu.json, runs.ours "
                  "and runs.auto", "the same file: the runtime's ledger (`*_predicted`) and its activation plan "
                  "(`report.planned_peak_bytes`), made for the run as it ran (mixed precision included)",
                  "nothing: both columns are the run's.")  # fmt: skip
    for name in ("ours", "auto"):
        r = ms["runs"].get(name)
        if not r or "model_state" not in r:
            continue
        m, rep = r["model_state"], r["report"]
        for what, key in (("host bytes", "host_bytes"), ("pinned bytes", "pinned_bytes"),
                          ("AdamW state bytes", "state_bytes")):  # fmt: skip
            row(sec, f"{name}: {what}", m[key], m[key + "_predicted"], "bytes", f"runs.{name}.model_state.{key}",
                f"runs.{name}.model_state.{key}_predicted", kind="runtime", headline=name == "ours")
        row(sec, f"{name}: device peak", rep["peak_device_bytes"], rep["planned_peak_bytes"], "bytes",
            f"runs.{name}.report.peak_device_bytes", f"runs.{name}.report.planned_peak_bytes",
            f"budget {fmt_value(rep['budget_bytes'], 'bytes')}", kind="runtime", headline=name == "ours")
    return sec


def swapped_resnet(lag: dict[str, Any]) -> dict[str, Any]:
    """The late-copies phase's ResNet: unswapped peak, swapped peak under the budget, reserved bytes."""
    budget = lag["budget"]
    kw: dict[str, Any] = {"optimizer": sgd_momentum(LAG_MODEL["lr"])}
    t0 = time.perf_counter()
    pred = predict_peak(lag_resnet, lag_batch, batch=LAG_MODEL["batch"], budget=budget, policy=LAG_MODEL["policy"],
                        device=DEVICE, min_bytes=LAG_MODEL["min_bytes"], **kw)  # fmt: skip
    trace = capture(lag_resnet, lag_batch, LAG_MODEL["batch"], **kw)
    mb = parse_size(LAG_MODEL["min_bytes"], "min_bytes")
    seq = sequence_from_trace(trace, min_bytes=mb)
    dev = device_profile(DEVICE)
    sched = schedule_for(seq, budget, LAG_MODEL["policy"], dev.h2d_bandwidth, dev.d2h_bandwidth).schedule
    replay = measure(swapped(trace, budget, LAG_MODEL["policy"], schedule=sched, min_bytes=mb), "pytorch_native")
    print(f"gpu_vs_forecast: swapped ResNet: forecast in {time.perf_counter() - t0:.0f} s", flush=True)
    sec = section(
        f"swapped ResNet (tests/gpu/swap_worker.py's resnet, batch 32), window policy, budget "
        f"{fmt_value(budget, 'bytes')}, native allocator, copies late", "swapped ResNet b32",
        "swap_lag.json (`swap_worker.py native --lag`)",
        f"`predict_peak(zoo.resnet((2, 2, 2, 2), width=32, num_classes=10), batch=32, budget={budget}, "
        "policy='window', min_bytes='256KiB', device='h200')` (SGD with momentum); reserved: the step captured, "
        "swapped by the window schedule under the budget (`swap.forecast.from_trace.swapped`) and replayed on "
        "`pytorch_native`",
        "The run's budget is 60 % of its own unswapped peak; the forecast plans the same bytes. The run's peaks "
        "count cuDNN's and cuBLAS's workspaces, which torch's allocator hands out and the capture does not "
        "record (a likely cause of the unswapped gap, not measured).",
    )  # fmt: skip
    row(sec, "peak without swapping", lag["no_swap_peak"], pred.no_swap_peak, "bytes", "no_swap_peak",
        "no_swap_peak")
    m, f = lag["report"]["peak_device_bytes"], pred.planned_peak
    row(sec, "peak swapped", m, f, "bytes", "report.peak_device_bytes (torch.cuda.max_memory_allocated)",
        "planned_peak", f"of the budget: measured {m / budget:.1%}, forecast {(f or 0) / budget:.1%}", headline=True)
    row(sec, "peak reserved swapped", lag["allocator_peak_reserved"], replay["peak_reserved"], "bytes",
        "allocator_peak_reserved", "swapped trace replayed on pytorch_native: peak_reserved",
        f"of the budget: measured {lag['allocator_peak_reserved'] / budget:.1%}, forecast "
        f"{replay['peak_reserved'] / budget:.1%}")
    return sec


# -- output ---------------------------------------------------------------------------------------------------
def fmt_value(v: Optional[float], unit: str) -> str:
    if v is None:
        return "-"
    if unit == "bytes":
        return f"{v / GiB:.2f} GiB" if v >= GiB else f"{v / 2**20:.1f} MiB"
    return f"{v:.3f} s" if v >= 1 else f"{v * 1e3:.1f} ms"


def fmt_error(e: Optional[float]) -> str:
    return "-" if e is None else f"{e * 100:+.1f} %"


KIND = {"simulated": "simulated", "derived": "derived", "runtime": "runtime's prediction"}


def table_line(figure: str, r: dict[str, Any], *extra: str) -> str:
    cells = [figure, fmt_value(r["measured"], r["unit"]), fmt_value(r["forecast"], r["unit"]), fmt_error(r["error"]),
             KIND[r["kind"]], *extra]  # fmt: skip
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def markdown(res: dict[str, Any], command: str) -> str:
    env, here = res["lease_environment"], res["forecast_environment"]
    lines = [
        "# A GPU lease's figures beside the forecast for the same runs",
        "",
        f"Measured: {env.get('device')} ({env.get('driver')}), torch {env.get('torch')}, commit "
        f"{env.get('git_commit')}, {env.get('date')}: the lease's files in this folder. Forecast: `{command}`, "
        f"on {here['machine']} (torch {here['torch']}, commit {here['git_commit']}), device profile "
        f"`{DEVICE}`: every forecast figure is simulated, none ran on a GPU. Error = forecast / measured - 1. "
        "\"derived\": composed from simulated figures by the formula in its row; \"runtime's prediction\": the "
        "runtime's own ledger or plan, read from the run's file, not the forecast. The 1B runs train in mixed "
        "precision (fp32 masters, bf16 compute): the model-state run is forecast in that format "
        "(`ModelStatePolicy(compute_dtype=torch.bfloat16)`), the plain run, which the forecast cannot price so, in "
        "the two formats nearest it, an fp32 model and a bf16 model; the sections say what differs (Note [Nearest "
        "configuration] in bench/gpu_vs_forecast.py).",
        "",
        "## Summary",
        "",
        "| figure | measured (H200) | forecast | error | forecast is |",
        "|---|---|---|---|---|",
    ]  # fmt: skip
    for sec in res["sections"]:
        for r in sec["rows"]:
            if r["headline"]:
                lines.append(table_line(f"{sec['short']}: {r['figure']}", r))
    for sec in res["sections"]:
        lines += ["", f"## {sec['title']}", "", f"Measured: {sec['measured_from']}.", "",
                  f"Forecast: {sec['forecast_by']}.", "", f"What differs: {sec['differs']}", "",
                  "| figure | measured (H200) | forecast | error | forecast is | measured key | forecast field | "
                  "note |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in sec["rows"]:
            lines.append(table_line(r["figure"], r, r["measured_key"], r["forecast_key"], r["note"] or "-"))
    lines += ["", f"The forecasts took {res['seconds']:.0f} s on this machine; every row in full: vs_forecast.json.",
              ""]  # fmt: skip
    return "\n".join(lines)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Capture and replay do not need the shared machine's second core."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def main(argv: Optional[list[str]] = None) -> int:
    import platform
    import subprocess

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lease", type=Path, default=LEASE, help="the lease's results folder")
    ap.add_argument("--out", type=Path, help="where vs_forecast.{json,md} go (default: --lease)")
    args = ap.parse_args(argv)
    out = args.out or args.lease
    alloc = json.loads((args.lease / "alloc_ratio.json").read_text())
    ms = json.loads((args.lease / "model_state_gpu.json").read_text())
    lag = json.loads((args.lease / "swap_lag.json").read_text())
    if ms.get("size") != "1b" or ms.get("micro_batches") != ACCUM_1B or ms.get("seq") != SEQ_1B:
        raise SystemExit(f"model_state_gpu.json is not the 1b run this compares (size {ms.get('size')})")
    t0 = time.perf_counter()
    sections: list[dict[str, Any]] = []
    with one_thread():
        sections += no_swap(alloc)
        sections += [plain_1b(ms, d) for d in ("fp32", "bf16")]
        sections.append(model_state_1b(ms, MIXED))
        sections.append(runtime_own(ms))
        sections.append(swapped_resnet(lag))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    res = {
        "lease": str(args.lease.relative_to(ROOT)) if args.lease.is_relative_to(ROOT) else str(args.lease),
        "lease_environment": alloc.get("environment", {}),
        "forecast_environment": {"machine": f"{platform.machine()} CPU, no GPU", "torch": torch.__version__,
                                 "git_commit": commit, "device_profile": DEVICE, "host_profile": HOST},
        "sections": sections,
        "seconds": time.perf_counter() - t0,
    }  # fmt: skip
    write_results(out, "vs_forecast", res, markdown(res, "python -m bench.gpu_vs_forecast"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
