"""Training throughput and peak memory at growing batch sizes under a device-memory limit, for ResNet-50
(torchvision) and a GPT-2-style model (swap.forecast.zoo), comparing: no swap; swap (window / fixed_distance / all)
with vmalloc and with torch's allocator; ``torch.autograd.graph.save_on_cpu(pin_memory=True)``; activation
checkpointing. Beside each measurement, the simulator's prediction from the profile that run measured.

    python -m bench.gpu.training [--limit 16GiB] [--seconds 420] [--models resnet50 gpt2]

The limit plays a smaller GPU: torch's allocator is capped with set_per_process_memory_fraction, vmalloc
with its capacity. Swap budgets: vmalloc's capacity (the whole limit: its chunks do not fragment); 90% of the
limit with torch's allocator, whose cached blocks need the headroom. Each (model, allocator, batch) runs in
its own process. Predictions: swap runs simulate their own schedule (swap.simulate) on the sequence they
profiled (per-step times from CUDA events) and the copy bandwidths they measured; no swap is the profiled
compute time; save_on_cpu copies every saved tensor on the compute stream (compute + bytes / bandwidth each
way); checkpointing recomputes the forward (compute + forward compute). Those three take the profile of the
window-swap run of the same batch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Optional

from bench.gpu import common

GiB = 1 << 30
BATCHES = {"resnet50": [96, 256, 384], "gpt2": [4, 8, 12]}
UNIT = {"resnet50": "images/s", "gpt2": "tokens/s"}
SEQ_LEN = 1024
NATIVE_MODES = ["none", "window", "fixed_distance", "all", "save_on_cpu", "checkpoint"]
VMALLOC_MODES = ["none", "window", "fixed_distance", "all"]
WARMUP, MEASURED = 2, 3  # iterations: the swap runtime profiles during the first two


# -- pure helpers (tested on CPU) -----------------------------------------------------------------------------


def predictions(seq: Any, h2d_bw: float, d2h_bw: float, budget: int) -> dict[str, float]:
    """Predicted seconds per iteration of each mode from one profiled sequence (see the module docstring)."""
    from swap.schedule import schedule_for

    compute = sum(seq.compute)
    forward = sum(c for c, k in zip(seq.compute, seq.kind) if k == "save")
    all_bytes = sum(seq.sizes)
    out = {"none": compute, "checkpoint": compute + forward,
           "save_on_cpu": compute + all_bytes / d2h_bw + all_bytes / h2d_bw}  # fmt: skip
    for policy in ("window", "fixed_distance", "all"):
        try:
            # window="auto", as the runs use it
            out[policy] = schedule_for(seq, budget, policy, h2d_bw, d2h_bw).sim.step_time
        except Exception:  # noqa: BLE001 - infeasible under this budget: no prediction
            continue
    return out


def throughput(model: str, batch: int, seconds_per_iter: float) -> float:
    return batch * (SEQ_LEN if model == "gpt2" else 1) / seconds_per_iter


# -- one (model, allocator, batch) process ----------------------------------------------------------------------


def build(model: str) -> tuple[Any, Any]:
    import torch

    from swap.forecast import zoo as models

    if model == "resnet50":
        try:
            import torchvision

            net = torchvision.models.resnet50()
        except Exception:  # noqa: BLE001 - torchvision missing or broken: the project's own ResNet-50
            net = models.resnet50()

        def batch_fn(b: int, it: int) -> tuple[Any, Any]:
            g = torch.Generator(device="cuda").manual_seed(it)
            return (torch.randn(b, 3, 224, 224, device="cuda", generator=g),
                    torch.randint(0, 1000, (b,), device="cuda", generator=g))  # fmt: skip

        return net.cuda(), batch_fn
    net = models.gpt2(seq_len=SEQ_LEN).cuda()

    def batch_fn(b: int, it: int) -> tuple[Any, Any]:
        g = torch.Generator(device="cuda").manual_seed(it)
        t = torch.randint(0, 50257, (b, SEQ_LEN + 1), device="cuda", generator=g)
        return t[:, :-1], t[:, 1:]

    return net, batch_fn


def run_config(model: str, allocator: str, batch: int, mode: str, limit: int) -> dict[str, Any]:
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    import swap
    import vmalloc

    torch.manual_seed(0)
    net, batch_fn = build(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    def forward(x: Any) -> Any:
        if mode != "checkpoint":
            return net(x)
        if model == "gpt2":
            h = net.tok(x) + net.pos(torch.arange(x.shape[1], device=x.device))
            for blk in net.blocks:
                h = checkpoint(blk, h, use_reentrant=False)
            return net.head(net.ln(h))
        if hasattr(net, "layer1"):  # torchvision's ResNet
            stages = [torch.nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool), net.layer1, net.layer2,
                      net.layer3, net.layer4]  # fmt: skip
        else:  # swap.forecast.zoo.ResNet
            stages = [net.stem, *net.blocks]
        h = x
        for s in stages:
            h = checkpoint(s, h, use_reentrant=False)
        return net.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))

    def loss_of(x: Any, y: Any) -> Any:
        out = forward(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    sm = None
    if mode in ("window", "fixed_distance", "all"):
        budget = None if allocator == "vmalloc" else int(0.9 * limit)  # vmalloc: its capacity is the limit
        sm = swap.SwapManager(budget=budget, policy=mode, min_bytes="1MiB")
    ctx = torch.autograd.graph.save_on_cpu(pin_memory=True) if mode == "save_on_cpu" else contextlib.nullcontext()
    times = []
    with contextlib.ExitStack() as stack:
        if sm is not None:
            stack.enter_context(sm)
        for it in range(WARMUP + MEASURED):
            if it == WARMUP:
                torch.cuda.synchronize()
                if allocator == "vmalloc":
                    vmalloc.global_arena(0).reset_peak_stats()
                elif sm is None:
                    torch.cuda.reset_peak_memory_stats()
            x, y = batch_fn(batch, it)
            t0 = time.perf_counter()
            with ctx:
                loss = loss_of(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    per_iter = sorted(times[WARMUP:])[len(times[WARMUP:]) // 2]
    row: dict[str, Any] = {"seconds_per_iter": per_iter, "throughput": throughput(model, batch, per_iter)}
    if allocator == "vmalloc":
        s = vmalloc.stats(0)
        row.update(peak_allocated=s["allocated_bytes.all.peak"], peak_reserved=s["reserved_bytes.all.peak"])
    elif sm is None:
        row.update(peak_allocated=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved())
    if sm is not None:
        rep = sm.report()
        row.update(peak_allocated=rep["peak_device_bytes"], swapped_out=rep["swapped_out_bytes"],
                   declined=rep["declined"], stall_seconds=rep["stall_seconds"])  # fmt: skip
        engine = sm.executor.engine
        h2d, d2h = engine.h2d_bw.rate(0.0), engine.d2h_bw.rate(0.0)
        if sm.sequence is not None and h2d > 0 and d2h > 0:
            row["profile"] = {"h2d_bw": h2d, "d2h_bw": d2h, "budget": sm.budget}
            row["predicted_seconds"] = predictions(sm.sequence, h2d, d2h, sm.budget)
            # The measured profile (per-step times on CUDA events), for `swap.plan --profile FILE` to calibrate
            # the roofline's efficiency on this device instead of the V100 figure.
            device = {"device": torch.cuda.get_device_properties(0).name}  # what environment() names the folder by
            prof = common.results_dir(device) / "profiles" / f"{model}-b{batch}-{allocator}-{mode}.json"
            prof.parent.mkdir(parents=True, exist_ok=True)
            sm.save_profile(prof)
            row["profile"]["path"] = str(prof.relative_to(common.ROOT))
    return row


def child(model: str, allocator: str, batch: int, limit: int) -> None:
    import torch

    import vmalloc

    if allocator == "vmalloc":
        torch.cuda.memory.change_current_allocator(vmalloc.allocator(capacity=limit))
    else:
        torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(0).total_memory)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = False  # heuristics: no autotuning time in a time-boxed run
    for mode in VMALLOC_MODES if allocator == "vmalloc" else NATIVE_MODES:
        try:
            row = run_config(model, allocator, batch, mode, limit)
        except torch.cuda.OutOfMemoryError:
            row = {"oom": True}
        except Exception as e:  # noqa: BLE001 - one failing mode must not lose the others
            row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        import gc

        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        row.update(model=model, allocator=allocator, batch=batch, mode=mode)
        print("ROW " + json.dumps(row), flush=True)


# -- the parent: runs the processes within the time box, writes as rows arrive --------------------------------


def attach_predictions(rows: list[dict[str, Any]]) -> None:
    """Gives every row the prediction for its mode from the window-swap profile of its batch (native)."""
    profiles = {(r["model"], r["batch"]): r["predicted_seconds"] for r in rows
                if r.get("mode") == "window" and r.get("predicted_seconds")}  # fmt: skip
    for r in rows:
        pred = (r.get("predicted_seconds") or profiles.get((r["model"], r["batch"])) or {}).get(r["mode"])
        if pred:
            r["predicted_throughput"] = throughput(r["model"], r["batch"], pred)


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    header = ["model", "batch", "allocator", "mode", "throughput", "predicted", "peak GiB", "swapped GiB"]
    out = []
    for r in sorted(rows, key=lambda r: (r["model"], r["batch"], r["allocator"], r["mode"])):
        status = "OOM" if r.get("oom") else r.get("error", "")
        out.append([r["model"], r["batch"], r["allocator"], r["mode"],
                    f"{r['throughput']:.0f} {UNIT[r['model']]}" if "throughput" in r else status,
                    f"{r['predicted_throughput']:.0f}" if "predicted_throughput" in r else "",
                    f"{r['peak_allocated'] / GiB:.2f}" if "peak_allocated" in r else "",
                    f"{r.get('swapped_out', 0) / GiB:.2f}"])  # fmt: skip
    return common.table(header, out)


def plot(rows: list[dict[str, Any]]) -> Any:
    from bench.plotting import pyplot

    plt = pyplot()
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(6 * max(1, len(models)), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for (alloc, mode) in sorted({(r["allocator"], r["mode"]) for r in rows if r["model"] == model}):
            mine = [r for r in rows if (r["model"], r["allocator"], r["mode"]) == (model, alloc, mode)]
            pts = sorted((r["batch"], r["throughput"]) for r in mine if "throughput" in r)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{mode} ({alloc})")
        ax.set_title(model)
        ax.set_xlabel("batch")
        ax.set_ylabel(UNIT[model])
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    return fig


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", default="16GiB", help="device memory the runs may use")
    p.add_argument("--seconds", type=float, default=420)
    p.add_argument("--models", nargs="+", default=list(BATCHES), choices=list(BATCHES))
    p.add_argument("--child", nargs=4, metavar=("MODEL", "ALLOCATOR", "BATCH", "LIMIT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]), int(args.child[3]))
        return 0
    from vmalloc import parse_size

    limit = parse_size(args.limit)
    common.require_gpu()
    env = common.environment()
    box = common.TimeBox(args.seconds)
    rows: list[dict[str, Any]] = []
    title = f"Training under a {args.limit} device-memory limit"
    per_model = args.seconds / len(args.models)
    for k, model in enumerate(args.models):
        model_box = common.TimeBox(min(box.left(), per_model * (k + 1) - (args.seconds - box.left())))
        for batch in BATCHES[model]:
            for allocator in ("native", "vmalloc"):
                if model_box.expired():
                    break
                cmd = [sys.executable, "-m", "bench.gpu.training", "--child", model, allocator, str(batch), str(limit)]
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=common.ROOT,
                                        env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
                watchdog = threading.Timer(max(0.0, model_box.left()), proc.kill)  # a hung run ends at the box
                watchdog.start()
                try:
                    for line in proc.stdout:
                        if line.startswith("ROW "):
                            rows.append(json.loads(line[4:]))
                            attach_predictions(rows)
                            common.write("training", title, {"limit": limit, "rows": rows}, markdown(rows), env)
                            last = rows[-1]
                            shown = last.get("throughput", last.get("error", "OOM"))
                            print(f"training: {model} b{batch} {allocator} {last['mode']}: {shown}", flush=True)
                        if model_box.expired():
                            print(f"training: time box reached in {model} batch {batch} ({allocator})", flush=True)
                            proc.kill()
                            break
                finally:
                    watchdog.cancel()
                    proc.wait()
    attach_predictions(rows)
    d = common.write("training", title, {"limit": limit, "rows": rows}, markdown(rows), env, figure=plot(rows),
                     notes=[__doc__.split("\n\n")[-1].replace("\n", " ")])  # fmt: skip
    print(f"training: wrote {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
