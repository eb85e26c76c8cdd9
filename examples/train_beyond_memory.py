"""Train ResNet-50 at a batch whose saved activations exceed the device-memory budget.

On a GPU, vmalloc is installed as PyTorch's allocator and the swap runtime keeps the device under
``--budget``; on CPU (``--device cpu``, the default without CUDA) the same runtime runs with the compute
device's live tensor bytes as the memory it budgets, measured independently by a LiveBytesMeter.

The run is done twice from the same seed, without and with swapping, and the losses must be identical.

    python examples/train_beyond_memory.py                      # CPU: ResNet-50, batch 32, 96x96 images
    python examples/train_beyond_memory.py --device cuda --batch 256 --image-size 224 --budget 12GiB
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import swap  # noqa: E402
import vmalloc  # noqa: E402
from swap.forecast import zoo as models  # noqa: E402


def train(args: argparse.Namespace, device: torch.device, manager: swap.SwapManager | None) -> dict:
    torch.manual_seed(0)
    model = models.resnet50(num_classes=100).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    meter = swap.LiveBytesMeter(device).track_existing() if device.type == "cpu" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    with contextlib.ExitStack() as stack:
        if meter is not None:
            stack.enter_context(meter)
        if manager is not None:
            stack.enter_context(manager)
        for it in range(args.iterations):
            x, y = models.example_batch(model, args.batch, args.image_size, torch.Generator().manual_seed(it), device)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = models.loss_fn(model, model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())  # synchronizes on CUDA
            times.append(time.perf_counter() - t0)
            print(f"  iteration {it}: loss {losses[-1]:.6f}, {args.batch / times[-1]:.1f} images/s", flush=True)
    if meter is not None:
        peak = meter.peak
    elif vmalloc.stats(device.index or 0):
        peak = vmalloc.stats(device.index or 0)["allocated_bytes.all.peak"]
    else:
        peak = torch.cuda.max_memory_allocated(device)
    steady = times[2:] or times
    return {"losses": losses, "peak": peak, "images_per_s": args.batch * len(steady) / sum(steady)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=96)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--budget", default=None, help="e.g. 12GiB; default: 60%% of the unswapped run's peak")
    ap.add_argument("--policy", default="window", choices=swap.POLICIES)
    ap.add_argument("--window", default="auto")
    ap.add_argument("--min-bytes", default="256KiB")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    if device.type == "cuda":
        # Before the first CUDA allocation. Its capacity is the whole device: the budget is the swap runtime's.
        torch.cuda.memory.change_current_allocator(vmalloc.allocator())

    print(f"ResNet-50, batch {args.batch}, {args.image_size}x{args.image_size} images, on {device}")
    print("without swapping:")
    ref = train(args, device, None)
    budget = vmalloc.parse_size(args.budget) if args.budget else int(ref["peak"] * 0.6)
    print(f"  peak {ref['peak'] / 2**20:.1f} MiB; budget for the swapped run: {budget / 2**20:.1f} MiB")
    print(f"with swapping (policy {args.policy}):")
    sm = swap.SwapManager(
        budget=budget, window=args.window, policy=args.policy, device=device, min_bytes=args.min_bytes
    )
    got = train(args, device, sm)
    report = sm.report()
    print()
    print(report)
    print()
    same = got["losses"] == ref["losses"]
    print(f"images/s without swapping {ref['images_per_s']:.1f}, with swapping {got['images_per_s']:.1f}")
    what = "live tensor bytes between operators (LiveBytesMeter)" if device.type == "cpu" else "device memory"
    print(f"peak {what} {got['peak'] / 2**20:.1f} MiB <= budget {budget / 2**20:.1f} MiB: {got['peak'] <= budget}")
    print(f"swapped out {report['swapped_out_bytes'] / 2**20:.1f} MiB; losses identical to the unswapped run: {same}")
    return 0 if same and got["peak"] <= budget and report["swapped_out_bytes"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
