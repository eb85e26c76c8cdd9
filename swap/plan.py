"""The largest batch that fits a budget, per policy, and its predicted speed.

    python -m swap.plan --model resnet50 --budget 16GiB [--device v100] [--allocator vmalloc]

Captures training steps on the meta device (no memory, cached under build/trace-cache), plans every
policy against the budget and simulates it on the device profile (swap.devices). With ``--allocator``, a
batch fits only if that allocator can hold the swapped run within the budget (its fragmentation lowers the
plan's budget; see bench/fragmentation.py).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

BATCHES = [16, 32, 64, 96, 128, 190, 256, 384, 512, 640, 768, 928, 1024, 1120, 1248, 1440, 1600, 1800, 2048, 2560,
           3072, 4096]  # fmt: skip


def predict(model: str, budget: int, device: str, policy: str, allocator: Optional[str], batches: list[int]):
    """Binary search over ``batches`` for the largest that fits; returns (batch, images/s) or (0, None)."""
    from bench.fragmentation import fitting_budget
    from bench.replay import measure
    from bench.swap_schedule import run_policy, sequence
    from bench.traces import cached_capture
    from swap.devices import profile

    dev = profile(device)

    def attempt(batch: int):
        trace = cached_capture(model, batch, 2)
        seq = sequence(trace, dev)
        if policy == "none":
            if seq.no_swap_peak() > budget:
                return None
            if allocator and not measure(trace, allocator, capacity=budget)["ok"]:
                return None
            return batch / sum(seq.compute)
        b = fitting_budget(trace, allocator, budget) if allocator else budget
        if b is None:
            return None
        r = run_policy(seq, dev, b, policy)
        return batch / r["step_time"] if r else None

    lo, hi, best = 0, len(batches) - 1, (0, None)
    while lo <= hi:
        mid = (lo + hi) // 2
        speed = attempt(batches[mid])
        print(f"  {policy}: batch {batches[mid]} {'fits' if speed else 'does not fit'}", file=sys.stderr, flush=True)
        if speed:
            best, lo = (batches[mid], speed), mid + 1
        else:
            hi = mid - 1
    return best


def main(argv: Optional[list[str]] = None) -> int:
    from bench.traces import MODELS
    from swap import POLICIES
    from swap.devices import PROFILES

    ap = argparse.ArgumentParser(prog="python -m swap.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", required=True, choices=sorted(MODELS))
    ap.add_argument("--budget", required=True, help="device memory, e.g. 16GiB")
    ap.add_argument("--device", default="v100", choices=sorted(PROFILES))
    ap.add_argument("--allocator", default=None, choices=["vmalloc", "pytorch_native", "pytorch_expandable"])
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--max-batch", type=int, default=4096)
    args = ap.parse_args(argv)
    import vmalloc

    budget = vmalloc.parse_size(args.budget)
    batches = [b for b in BATCHES if b <= args.max_batch]
    print(f"{args.model}, budget {budget / 2**30:.1f} GiB, {PROFILES[args.device].name}"
          + (f", allocator {args.allocator}" if args.allocator else ""))  # fmt: skip
    print(f"{'policy':<16}{'largest batch':>14}{'images/s':>12}")
    for policy in args.policies.split(","):
        if policy not in POLICIES:
            ap.error(f"unknown policy {policy!r}")
        batch, speed = predict(args.model, budget, args.device, policy, args.allocator, batches)
        print(f"{policy:<16}{batch or 'none fits':>14}{(f'{speed:.0f}' if speed else '-'):>12}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
