"""The allocators side by side on the same training step: torch's native caching allocator, its expandable
segments, vmalloc as torch's allocator (global) and vmalloc under a ``MemPool`` (torch's cache in front of
vmalloc's memory).

    python -m bench.gpu.alloc_ratio [--models gpt2 resnet50] [--warmup 10] [--timed 20] [--out DIR]
        [--device cuda|cpu]

One process per (model, allocator), in the order native, expandable, vmalloc, vmalloc_pool, native: native
is repeated last, so drift of the machine over the run shows as the two natives' difference. Each process trains
``--warmup`` iterations and then ``--timed`` ones with no synchronisation inside the timed block (one before it,
one after): wall seconds per iteration from the block, device seconds per iteration from CUDA events, main-thread
CPU seconds from ``time.thread_time``. vmalloc's maps, unmaps, access changes and host syncs (event
synchronisations) and its allocs and frees are read after every iteration from the first, so the growth phase
is visible apart from the steady one. Then, on the allocator the model trained on: the host cost of one
``torch.empty`` + free at 4 KiB and at 8 MiB (10 000 pairs), and a 1 GiB device copy's bandwidth, which would
show an effect of memory mapped chunk by chunk. Models: GPT-2 (swap.forecast.zoo, batch 4, sequence 1024, TF32)
and ResNet-50 (torchvision, batch 96). Writes DIR/alloc_ratio.json after every process.

``--device cpu`` (the lease's smoke mode) runs tiny models with the native allocator only; the others need CUDA
and are recorded as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from bench.gpu import common

ALLOCATORS = ["native", "expandable", "vmalloc", "vmalloc_pool", "native"]
BATCH = {"gpt2": 4, "resnet50": 96}
UNIT = {"gpt2": "tokens/s", "resnet50": "images/s"}
COUNTERS = ("num_maps", "num_unmaps", "num_set_access", "num_event_syncs", "num_alloc", "num_free")
EXPANDABLE = "expandable_segments:True"


def build(model: str, dev: Any) -> tuple[Any, list[tuple[Any, Any]], int]:
    """The model, a few batches on the device, and the items (tokens or images) a batch holds."""
    import torch

    from swap.forecast import zoo

    torch.manual_seed(0)
    cuda = dev.type == "cuda"
    g = torch.Generator().manual_seed(0)
    if model == "gpt2":
        seq, batch = (1024, BATCH[model]) if cuda else (64, 2)
        net = zoo.gpt2(seq_len=seq) if cuda else zoo.gpt(n_layer=2, n_head=2, d_model=64, vocab=512, seq_len=seq)
        vocab = net.tok.num_embeddings
        batches = []
        for _ in range(2):
            t = torch.randint(0, vocab, (batch, seq + 1), generator=g)
            batches.append((t[:, :-1].to(dev), t[:, 1:].to(dev)))
        return net.to(dev), batches, batch * seq
    batch, size = (BATCH[model], 224) if cuda else (2, 64)
    try:
        import torchvision

        net = torchvision.models.resnet50() if cuda else zoo.resnet((1, 1, 1, 1), width=8)
    except Exception:  # noqa: BLE001 - torchvision missing: the project's own ResNet
        net = zoo.resnet50() if cuda else zoo.resnet((1, 1, 1, 1), width=8)
    batches = [(torch.randn(batch, 3, size, size, generator=g).to(dev), torch.randint(0, 1000, (batch,),
                generator=g).to(dev)) for _ in range(2)]  # fmt: skip
    return net.to(dev), batches, batch


def per_call_ns(dev: Any, nbytes: int, pairs: int) -> float:
    """Host nanoseconds of one ``torch.empty(nbytes)`` and its free, on the current allocator."""
    import torch

    x = torch.empty(nbytes, dtype=torch.uint8, device=dev)  # warm: the block is cached from here on
    del x
    t0 = time.perf_counter()
    for _ in range(pairs):
        x = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        del x
    return (time.perf_counter() - t0) / pairs * 1e9


def copy_gbps(dev: Any, nbytes: int, repeats: int = 5) -> float:
    """A device-to-device copy's bandwidth (bytes read and written, GB/s) on memory of the current allocator."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src)
        return 2 * nbytes * repeats / (time.perf_counter() - t0) / 1e9
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(repeats):
        dst.copy_(src)
    b.record()
    b.synchronize()
    return 2 * nbytes * repeats / (a.elapsed_time(b) / 1e3) / 1e9


def child(model: str, allocator: str, warmup: int, timed: int, device: str) -> dict[str, Any]:
    import contextlib

    import torch
    import torch.nn.functional as F

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    scope: Any = contextlib.nullcontext()
    counters = None
    if allocator in ("vmalloc", "vmalloc_pool"):
        import vmalloc

        if allocator == "vmalloc":
            torch.cuda.memory.change_current_allocator(vmalloc.allocator())
        else:
            scope = vmalloc.use_mem_pool(vmalloc.mem_pool())

        def counters() -> dict[str, int]:
            s = vmalloc.stats(0)
            return {k: s.get(k, 0) for k in COUNTERS}

    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    with scope:
        net, batches, items = build(model, dev)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

        def step(i: int) -> None:
            x, y = batches[i % len(batches)]
            out = net(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        per_iteration: list[dict[str, int]] = []
        last = counters() if counters else None
        events, cpu = [], []
        wall0 = 0.0
        for i in range(warmup + timed):
            if i == warmup:
                if cuda:
                    torch.cuda.synchronize()
                wall0 = time.perf_counter()
            c0 = time.thread_time()
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                step(i)
                b.record()
                events.append((a, b))
            else:
                step(i)
            cpu.append(time.thread_time() - c0)
            if counters:
                now = counters()
                per_iteration.append({k: now[k] - last[k] for k in COUNTERS})
                last = now
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - wall0) / timed
        gpu = [a.elapsed_time(b) / 1e3 for a, b in events]
        row: dict[str, Any] = {
            "wall_seconds_per_iteration": wall, "throughput": items / wall,
            "device_seconds_per_iteration": statistics.median(gpu[warmup:]) if gpu else None,
            "cpu_seconds_per_iteration": statistics.median(cpu[warmup:]),
            "first_iteration_cpu_seconds": cpu[0],
            "first_iteration_device_seconds": gpu[0] if gpu else None,
        }  # fmt: skip
        if per_iteration:
            steady = per_iteration[warmup:]
            row["vmalloc_per_iteration"] = per_iteration
            row["vmalloc_steady_max"] = {k: max(r[k] for r in steady) for k in COUNTERS}
            row["vmalloc_first_iteration"] = per_iteration[0]
        if cuda:
            row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            row["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        pairs = 10_000 if cuda else 1_000
        row["alloc_free_ns"] = {"4KiB": per_call_ns(dev, 4 << 10, pairs), "8MiB": per_call_ns(dev, 8 << 20, pairs)}
        row["copy_gbps"] = copy_gbps(dev, (1 << 30) if cuda else (16 << 20))
    return row


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per model: each allocator's throughput over the first native run's; the natives' drift."""
    out: dict[str, Any] = {}
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model and "throughput" in r]
        natives = [r for r in mine if r["allocator"] == "native"]
        if not natives:
            continue
        base = natives[0]["throughput"]
        out[model] = {r["allocator"] + ("_repeat" if r is natives[-1] and len(natives) > 1 else ""):
                      r["throughput"] / base for r in mine}  # fmt: skip
    return out


def figure(result: dict[str, Any]) -> str:
    parts = []
    for model, r in result["ratio_to_native"].items():
        native = next(x for x in result["rows"] if x["model"] == model and x["allocator"] == "native")
        shown = "".join(f", {k} {v:.3f}x" for k, v in r.items() if k != "native")
        parts.append(f"{model}: native {native['throughput']:.4g} {native['unit']}{shown}")
    skipped = sorted({r["allocator"] for r in result["rows"] if r.get("skipped")})
    if skipped:
        parts.append(f"skipped: {', '.join(skipped)} (no CUDA)")
    errors = [f"{r['model']} {r['allocator']}: {r['error']}" for r in result["rows"] if r.get("error")]
    return "; ".join(parts + errors) or "no process finished"


def parser() -> argparse.ArgumentParser:
    """The command line (the lease checks its own commands against it on the CPU)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt2", "resnet50"], choices=sorted(BATCH))
    p.add_argument("--allocators", nargs="+", default=ALLOCATORS, choices=sorted(set(ALLOCATORS)))
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--timed", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seconds", type=float, default=300, help="time for all the processes")
    p.add_argument("--out", type=Path, default=Path("build/lease"))
    p.add_argument("--child", nargs=2, metavar=("MODEL", "ALLOCATOR"), help=argparse.SUPPRESS)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.child:
        row = child(args.child[0], args.child[1], args.warmup, args.timed, args.device)
        print("RESULT " + json.dumps(row, default=str), flush=True)
        return 0
    cuda = args.device.startswith("cuda")
    if cuda:
        common.require_gpu()
    box = common.TimeBox(args.seconds)
    result: dict[str, Any] = {"environment": common.environment(), "warmup": args.warmup, "timed": args.timed,
                              "device": args.device, "rows": [], "ratio_to_native": {}}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "alloc_ratio.json"
    for model in args.models:
        for allocator in args.allocators:
            row: dict[str, Any] = {"model": model, "allocator": allocator, "batch": BATCH[model], "unit": UNIT[model]}
            if not cuda and allocator != "native":
                row.update(skipped=True, status="skipped: no CUDA")
            elif box.left() < 5:
                row.update(skipped=True, status="skipped: the time box was used up")
            else:
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                if allocator == "expandable":
                    env.update(PYTORCH_CUDA_ALLOC_CONF=EXPANDABLE, PYTORCH_ALLOC_CONF=EXPANDABLE)
                cmd = [sys.executable, "-m", "bench.gpu.alloc_ratio", "--child", model, allocator, "--warmup",
                       str(args.warmup), "--timed", str(args.timed), "--device", args.device]  # fmt: skip
                t0 = time.perf_counter()
                try:
                    r = subprocess.run(cmd, cwd=common.ROOT, env=env, capture_output=True, text=True,
                                       timeout=max(5.0, box.left()))  # fmt: skip
                    found = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
                    if found:
                        row.update(json.loads(found[-1][len("RESULT "):]))
                    else:
                        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
                        row.update(error=f"exit {r.returncode}: {tail[:300]}")
                        print(r.stderr[-3000:], file=sys.stderr, flush=True)
                except subprocess.TimeoutExpired:
                    row.update(error="timed out")
                row["process_seconds"] = round(time.perf_counter() - t0, 1)
            result["rows"].append(row)
            result["ratio_to_native"] = ratios(result["rows"])
            result["figure"] = figure(result)
            path.write_text(json.dumps(result, indent=1, default=str) + "\n")
            shown = row.get("error") or row.get("status") or f"{row['throughput']:.0f} {row['unit']}"
            print(f"alloc_ratio: {model} {allocator}: {shown}", flush=True)
    print(f"alloc_ratio: {result['figure']}; wrote {path}", flush=True)
    return 0 if not any(r.get("error") for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
