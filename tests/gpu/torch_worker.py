"""One process per allocator mode (torch's allocator is process-wide): trains a model, or checks torch's
memory API against vmalloc, and prints one JSON line. tests/gpu/test_torch_allocator.py drives it.

    python torch_worker.py train {cnn,transformer} {default,vmalloc,vmalloc_pool}
    python torch_worker.py parity          # vmalloc as torch's global allocator, through the adapter
    python torch_worker.py pool_mode       # vmalloc.use_mem_pool: every thread, graphs, OOM without handler
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MiB = 1 << 20


def _global_mean_class() -> Any:
    from torch import nn

    class GlobalMean(nn.Module):
        """Average over H and W with a plain reduction (AdaptiveAvgPool2d's backward has no deterministic mode)."""

        def forward(self, x: Any) -> Any:
            return x.mean(dim=(2, 3))

    return GlobalMean


def build_model(name: str) -> Any:
    import torch
    from torch import nn

    from swap.forecast.zoo import gpt

    GlobalMean = _global_mean_class()
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            GlobalMean(), nn.Linear(64, 10),
        ).cuda()  # fmt: skip
    if name == "transformer":
        torch.manual_seed(0)
        return gpt(n_layer=2, n_head=4, d_model=128, vocab=512, seq_len=64).cuda()
    raise ValueError(f"unknown model {name!r}: cnn or transformer")


def batch(name: str, g: Any) -> tuple[Any, Any]:
    import torch

    if name == "cnn":
        return torch.randn(32, 3, 32, 32, generator=g).cuda(), torch.randint(0, 10, (32,), generator=g).cuda()
    tokens = torch.randint(0, 512, (8, 65), generator=g)
    return tokens[:, :-1].cuda(), tokens[:, 1:].cuda()


def loss_of(model: Any, x: Any, y: Any) -> Any:
    import torch.nn.functional as F

    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def train(name: str, steps: int = 4) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    model = build_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = batch(name, g)
        loss = loss_of(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    return {"losses": [repr(v) for v in losses], "params_sha256": digest.hexdigest(), "model": model}


def deterministic() -> None:
    """Deterministic kernels wherever torch has them; ops without one (nll_loss's CUDA forward, for one) only
    warn: for these shapes they do not use atomics, so repeated runs are bitwise equal."""
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def cmd_train(name: str, mode: str) -> dict[str, Any]:
    import torch

    import vmalloc

    deterministic()
    if mode == "vmalloc":
        torch.cuda.memory.change_current_allocator(vmalloc.allocator(capacity="8GiB"))
        r = train(name)
    elif mode == "vmalloc_pool":
        pool = vmalloc.mem_pool()
        with vmalloc.use_mem_pool(pool):
            r = train(name)
            arena = vmalloc.global_arena(0)
            # Parameters and gradients (made on autograd's device thread) all live in vmalloc's memory.
            outside = [n for n, p in r["model"].named_parameters()
                       if not arena.is_live(p.grad.data_ptr(), p.grad.numel() * p.grad.element_size())]  # fmt: skip
            r["grads_outside_pool"] = outside
    else:
        r = train(name)
    r.pop("model")
    r["vmalloc_stats"] = vmalloc.stats(0)
    r["adapter"] = vmalloc.adapter_status()
    return r


def expect_error(fn: Callable[[], Any], kind: type, *fragments: str) -> str:
    try:
        fn()
    except kind as e:
        text = str(e)
        missing = [f for f in fragments if f not in text]
        assert not missing, f"error lacks {missing}: {text[:500]}"
        return text
    raise AssertionError(f"{fn} did not raise {kind.__name__}")


def cmd_parity() -> dict[str, Any]:
    import torch

    import vmalloc

    capacity = 4 << 30
    torch.cuda.memory.change_current_allocator(vmalloc.allocator(capacity=capacity))
    status = vmalloc.adapter_status()
    assert status["adapter"], f"the torch adapter is not in use: {status['reason']}"
    assert vmalloc.installed()
    out: dict[str, Any] = {"adapter": status}

    # memory_stats and friends report the arena's own figures.
    x = torch.empty(300 * MiB, dtype=torch.uint8, device="cuda")
    y = torch.empty(1000, device="cuda")
    s, ts = vmalloc.stats(0), torch.cuda.memory_stats(0)
    keys = ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
            "requested_bytes.all.current", "allocation.all.current", "segment.all.current", "num_ooms")
    for key in keys:
        assert ts[key] == s[key], (key, ts[key], s[key])
    assert torch.cuda.memory_allocated(0) == s["allocated_bytes.all.current"]
    assert torch.cuda.max_memory_allocated(0) == s["allocated_bytes.all.peak"]
    assert torch.cuda.memory_reserved(0) == s["reserved_bytes.all.current"]
    torch.cuda.memory_summary(0)  # formats every key without raising
    del x
    torch.cuda.reset_peak_memory_stats(0)
    assert torch.cuda.max_memory_allocated(0) == torch.cuda.memory_allocated(0) == vmalloc.stats(0)[
        "allocated_bytes.all.current"]  # fmt: skip
    torch.cuda.reset_accumulated_memory_stats(0)
    assert torch.cuda.memory_stats(0)["allocated_bytes.all.allocated"] == 0
    w = torch.empty(MiB, dtype=torch.uint8, device="cuda")  # a 1 MiB small block: exactly 1 MiB allocated
    assert torch.cuda.memory_stats(0)["allocated_bytes.all.allocated"] == MiB
    del w
    out["stats_match"] = True

    # Out of memory: torch.cuda.OutOfMemoryError with vmalloc's explanation; the allocator stays usable.
    msg = expect_error(lambda: torch.empty(2 * capacity, dtype=torch.uint8, device="cuda"),
                       torch.cuda.OutOfMemoryError, "CUDA out of memory.", "vmalloc")  # fmt: skip
    assert isinstance(torch.cuda.OutOfMemoryError("x"), RuntimeError)
    z = torch.ones(10, device="cuda")
    assert float(z.sum()) == 10.0
    out["oom_message"] = msg[:300]
    assert torch.cuda.memory_stats(0)["num_ooms"] >= 1

    # cudnn.benchmark=True calls cacheInfo; a training step of a CNN must work.
    torch.backends.cudnn.benchmark = True
    model = build_model("cnn")
    g = torch.Generator().manual_seed(0)
    xb, yb = batch("cnn", g)
    loss_of(model, xb, yb).backward()
    torch.cuda.synchronize()
    out["cudnn_benchmark_step"] = True

    # Snapshot / history: a clear error naming vmalloc.snapshot(); vmalloc's own snapshot works.
    expect_error(lambda: torch.cuda.memory._snapshot(), RuntimeError, "vmalloc.snapshot(")
    expect_error(lambda: torch.cuda.memory._record_memory_history(), RuntimeError, "vmalloc.snapshot(")
    torch.cuda.memory._record_memory_history(enabled=None)  # turning it off is fine
    snap = vmalloc.snapshot(0)
    assert snap["segments"] and all(seg["device"] == 0 for seg in snap["segments"])

    # Graph capture fails at capture begin, naming the alternative; nothing is corrupted.
    keep = torch.full((1 << 20,), 5.0, device="cuda")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        expect_error(graph.capture_begin, RuntimeError, "vmalloc.use_mem_pool", "CUDA graph")
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert not torch.cuda.is_current_stream_capturing()
    assert float(keep.sum()) == 5.0 * (1 << 20)
    out["graph_capture_refused"] = True

    # empty_cache, memory fraction and record_stream reach vmalloc.
    del keep, z, y, model, xb, yb
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # Memory goes back in whole blocks (Note [Blocks and slices]): nothing cached, no wholly free block left;
    # what stays free belongs to blocks that still hold a chunk in use. Every chunk still held is in a live
    # allocation, in a slab that holds a block in use, or free in the pool. Slabs are per stream: the default
    # stream's holds what torch keeps (e.g. cuBLASLt's workspace), and the refused capture left torch's
    # generator two 8-byte tensors on the side stream (Note [A refused capture]), a second slab of 2 MiB
    # holding 1 KiB. A bound of one slab's 2 MiB failed on the H200 for that reason.
    s = vmalloc.stats(0)
    assert s["num_cached_chunks"] == 0 and s["num_releasable_chunks"] == 0, s
    assert s["reserved_bytes.all.current"] <= s["allocated_bytes.all.current"] + s["slab_bytes.all.current"] + (
        s["num_pool_chunks"] * s["chunk_size"]), s  # fmt: skip
    out["slabs_after_empty_cache"] = s["slab_bytes.all.current"] // (2 * MiB)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.25, 0)
    assert abs(vmalloc.stats(0)["capacity"] - 0.25 * total) <= 2 * MiB
    t = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    t.record_stream(side)
    del t
    out["hooks"] = True
    return out


def cmd_pool_mode() -> dict[str, Any]:
    import torch

    import vmalloc

    calls: list[int] = []
    pool = vmalloc.mem_pool(capacity="1GiB")
    assert not vmalloc.installed()
    vmalloc.set_oom_handler(lambda n: calls.append(n) or False)
    out: dict[str, Any] = {"adapter": vmalloc.adapter_status()}
    arena = vmalloc.global_arena(0)

    # Every thread's allocations go to the pool: autograd's device thread makes the gradients.
    with vmalloc.use_mem_pool(pool):
        model = build_model("transformer")
        g = torch.Generator().manual_seed(0)
        x, y = batch("transformer", g)
        loss_of(model, x, y).backward()
        torch.cuda.synchronize()
    outside = [n for n, p in model.named_parameters()
               if not arena.is_live(p.grad.data_ptr(), p.grad.numel() * p.grad.element_size())]  # fmt: skip
    assert not outside, f"gradients allocated outside vmalloc's pool: {outside}"

    # Graph capture works in this mode: torch's own allocator is the current one.
    static_in = torch.ones(1024, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        static_out = static_in * 2  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        static_out = static_in * 3
    static_in.fill_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    assert float(static_out.sum()) == 6.0 * 1024
    out["graph_capture"] = True

    # Out of memory inside the pool: torch.cuda.OutOfMemoryError, and vmalloc never ran its OOM handler
    # (torch's allocator lock is held there).
    with vmalloc.use_mem_pool(pool):
        expect_error(lambda: torch.empty(3 << 30, dtype=torch.uint8, device="cuda"), torch.cuda.OutOfMemoryError,
                     "out of memory")  # fmt: skip
    assert calls == [], f"the OOM handler ran in MemPool mode: {calls}"
    out["pool_oom_without_handler"] = True
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("model", choices=["cnn", "transformer"])
    t.add_argument("mode", choices=["default", "vmalloc", "vmalloc_pool"])
    sub.add_parser("parity")
    sub.add_parser("pool_mode")
    args = p.parse_args(argv)
    if args.cmd == "train":
        result = cmd_train(args.model, args.mode)
    elif args.cmd == "parity":
        result = cmd_parity()
    else:
        result = cmd_pool_mode()
    print("RESULT " + json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
