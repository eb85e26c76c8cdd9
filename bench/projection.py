"""Swapping on the GPUs people have now: the window schedule at 5x and 10x the no-swap batch, simulated.

    python -m bench.projection              # ResNet-50 fp32 224^2 and GPT-2-medium bf16 seq 1024 on H100
    python -m bench.projection --quick      # a smoke run (small batches)

An H100 computes many times faster than the window-scheduling paper's V100 while the host link grew only from NVLink2
(50 GB/s per direction, POWER9) to PCIe Gen5 (~55 GB/s): swapping that hid behind compute on a V100 becomes link-bound.
For each workload: the largest batch B0 that trains without swapping (the sequence's peak within the device memory and
vmalloc holding the run), then 5x and 10x B0 with the window schedule, three ways: with an ideal
allocator, with vmalloc (its driver calls charged, bench.vmm_costs), and with recompute-instead-of-swap for the
tensors swap.joint.recompute can rebuild (ideal allocator). Reported: throughput retained against B0 without
swapping, the stall, its link-bound fraction (the part copies spent queued behind other copies), the
forward/backward split of the stall, and the bytes moved.

Writes <out>/projection.json, projection.md and projection.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from bench.plotting import pyplot, save
from bench.swap_schedule import STEPS, run_policy, sequence, window_with_allocator
from bench.traces import MODELS, cached_capture
from bench.vmm_costs import for_device
from swap import InfeasibleBudget, Sequence, choose_window
from swap.capture.target import target_kernels
from swap.devices import DeviceProfile, profile
from swap.forecast import zoo as models
from swap.forecast.replay.replay import measure
from swap.joint.recompute import choose, recipes, with_recompute

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30
FULL = {"resnet50": None, "gpt2-medium-bf16": None}
QUICK = {"resnet50": 96}  # (model, input size): a small, fast stand-in
MULTIPLES = (5, 10)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def no_swap_batch(model: str, size: Optional[int], dev: DeviceProfile, memory: int) -> int:
    """The largest batch whose iteration fits ``memory`` without swapping (vmalloc holding it). The peak grows
    affinely with the batch: two captures predict it, a few more settle it."""

    def peak(b: int) -> int:
        return sequence(cached_capture(model, b, 2, size), dev).no_swap_peak()

    def fits(b: int) -> bool:
        if b <= 0 or peak(b) > memory:
            return False
        return measure(cached_capture(model, b, 2, size), "vmalloc", capacity=memory)["ok"]

    p8, p16 = peak(8), peak(16)
    b = max(1, int(8 + (memory - p8) * 8 / max(1, p16 - p8)))
    while b > 0 and not fits(b):
        b -= 1
    while fits(b + 1):
        b += 1
    return b


def phase_stalls(seq: Sequence, stalls: list[float]) -> tuple[float, float]:
    first_use = seq.kind.index("use") if "use" in seq.kind else len(seq)
    return sum(stalls[:first_use]), sum(stalls[first_use:])


def rebuild_seconds(dev: DeviceProfile, lowp: bool):
    return lambda r: dev.step_seconds(r.flops, r.nbytes, lowp)


def window_time(dev: DeviceProfile, budget: int):
    def step_time(seq: Sequence) -> float:
        try:
            return choose_window(seq, budget, dev.h2d_bandwidth, dev.d2h_bandwidth)[2].step_time
        except InfeasibleBudget:
            return float("inf")

    return step_time


def describe(row: dict[str, Any], seq: Sequence, dev: DeviceProfile) -> dict[str, Any]:
    """What the simulated window schedule spends its time on."""
    sched = row.pop("_schedule")
    from swap import simulate

    sim = simulate(seq, sched, dev.h2d_bandwidth, dev.d2h_bandwidth)
    fwd, bwd = phase_stalls(seq, sim.stalls)
    first_use = seq.kind.index("use")
    row.update(
        forward_compute=sum(seq.compute[:first_use]), backward_compute=sum(seq.compute[first_use:]),
        forward_stall=fwd, backward_stall=bwd, link_fraction=sim.link_stall / sim.stall_time if sim.stall_time else 0.0,
        d2h_seconds=sim.d2h_bytes / dev.d2h_bandwidth, h2d_seconds=sim.h2d_bytes / dev.h2d_bandwidth,
    )  # fmt: skip
    return row


def run_workload(model: str, size: Optional[int], dev: DeviceProfile, memory: int, costs: Any) -> dict[str, Any]:
    lowp = model.endswith("bf16")
    b0 = no_swap_batch(model, size, dev, memory)
    if b0 == 0:
        raise ValueError(f"{model} does not train at batch 1 within {memory / GiB:.1f} GiB: raise --memory")
    t0 = cached_capture(model, b0, 2, size)
    base_speed = b0 / sum(sequence(t0, dev).compute)
    log(f"{model}: largest batch without swapping {b0} ({base_speed:.1f}/s)")
    out: dict[str, Any] = {"model": model, "size": size, "no_swap_batch": b0, "no_swap_per_s": base_speed, "rows": []}
    for k in MULTIPLES:
        batch = k * b0
        trace = cached_capture(model, batch, STEPS, size)
        seq = sequence(trace, dev)
        floor = seq.step_floor()
        row: dict[str, Any] = {"multiple": k, "batch": batch, "compute_time": sum(seq.compute),
                               "no_swap_peak": seq.no_swap_peak(), "floor": floor}  # fmt: skip
        window = run_policy(seq, dev, memory, "window")
        row["window"] = describe(window, seq, dev) if window else None
        vm = window_with_allocator(trace, seq, dev, memory, "vmalloc", costs)
        if vm:
            vm.pop("_schedule")
        row["window+vmalloc"] = vm
        with torch.device("meta"):
            net = MODELS[model][0]().to(torch.bfloat16 if lowp else torch.float32)
        x, _ = models.example_batch(net, batch, size or MODELS[model][1], None, "meta")
        xs = x.untyped_storage()
        with target_kernels("cuda"):  # the capture's attention kernels, so the forward saves what it saved
            found = recipes(net, (x,), exclude=lambda t, xs=xs: t.untyped_storage() is xs, expect_sizes=seq.sizes)
        row["recompute_candidates"] = len(found)
        if found and window:
            chosen, _ = choose(seq, found, rebuild_seconds(dev, lowp), window_time(dev, memory))
            rseq = with_recompute(seq, chosen, rebuild_seconds(dev, lowp))
            rc = run_policy(rseq, dev, memory, "window")
            row["window+recompute"] = describe(rc, rseq, dev) if rc else None
            row["recomputed"] = len(chosen)
            row["recomputed_bytes"] = sum(seq.sizes[v] for v in chosen)
        for key in ("window", "window+vmalloc", "window+recompute"):
            r = row.get(key)
            if r:
                r["per_s"] = batch / r["step_time"]
                r["retained"] = r["per_s"] / base_speed
        out["rows"].append(row)
        w, v, r = (row.get(c) for c in ("window", "window+vmalloc", "window+recompute"))
        log(f"  {k}x = batch {batch}: window {fmt(w)}, +vmalloc {fmt(v)}, +recompute {fmt(r)}")
    return out


def fmt(r: Optional[dict]) -> str:
    return "does not fit" if not r else f"{r['per_s']:.1f}/s ({100 * r['retained']:.0f}% retained)"


def markdown(results: dict[str, Any]) -> str:
    m = results["meta"]
    lines = [f"Command: `{m['command']}` ({m['date']}); device profile: {m['device']}, {m['memory'] / GiB:.0f} GiB; "
             f"VMM costs: {m['vmm_costs']}.", "",
             "Throughput retained = (batch / simulated step time) / (B0 / compute time at B0), B0 the largest batch "
             "without swapping. Stall: seconds the compute stream waits per iteration; link-bound: the part of it "
             "spent while the awaited copy queued behind other copies.", ""]  # fmt: skip
    for w in results["workloads"]:
        lines += [f"### {w['model']}" + (f" (input size {w['size']})" if w["size"] else ""), "",
                  f"No swap: largest batch {w['no_swap_batch']}, {w['no_swap_per_s']:.1f}/s.", "",
                  "| multiple | batch | column | per s | retained | step s | compute s | stall s (fwd / bwd) "
                  "| link-bound | D2H s | H2D s | VMM s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for row in w["rows"]:
            for key in ("window", "window+vmalloc", "window+recompute"):
                r = row.get(key)
                if not r:
                    why = ("nothing to rebuild" if key == "window+recompute" and not row.get("recompute_candidates")
                           else "does not fit")  # fmt: skip
                    lines.append(f"| {row['multiple']}x | {row['batch']} | {key} | {why} | | | | | | | | |")
                    continue
                split = f" ({r['forward_stall']:.2f} / {r['backward_stall']:.2f})" if "forward_stall" in r else ""
                link = f"{100 * r['link_fraction']:.0f}%" if "link_fraction" in r else (
                    f"{100 * r['link_stall'] / r['stall']:.0f}%" if r.get("stall") else "-")  # fmt: skip
                d2h = f"{r['d2h_bytes'] / results['meta']['d2h_bandwidth']:.2f}"
                h2d = f"{r['h2d_bytes'] / results['meta']['h2d_bandwidth']:.2f}"
                lines.append(
                    f"| {row['multiple']}x | {row['batch']} | {key} | {r['per_s']:.1f} | {100 * r['retained']:.0f}% "
                    f"| {r['step_time']:.2f} | {row['compute_time']:.2f} | {r['stall']:.2f}{split} | {link} | {d2h} "
                    f"| {h2d} | {r.get('vmm_time', 0.0):.2f} |"
                )
            if row.get("recomputed") is not None:
                lines.append(f"| | | | recompute: {row['recomputed']} of {row['recompute_candidates']} candidates, "
                             f"{row['recomputed_bytes'] / GiB:.1f} GiB not moved | | | | | | | | |")  # fmt: skip
        lines.append("")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], out: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results["workloads"]), figsize=(5 * len(results["workloads"]), 4), squeeze=False)
    for ax, w in zip(axes[0], results["workloads"]):
        keys = ("window", "window+vmalloc", "window+recompute")
        xs = range(len(w["rows"]))
        for j, key in enumerate(keys):
            ax.bar([x + 0.27 * (j - 1) for x in xs],
                   [100 * (r.get(key) or {}).get("retained", 0) for r in w["rows"]], 0.27, label=key)  # fmt: skip
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['multiple']}x (batch {r['batch']})" for r in w["rows"]])
        ax.set_ylabel("% of no-swap throughput")
        ax.set_title(f"{w['model']} on {results['meta']['device'].split(',')[0]}", fontsize=9)
        ax.legend(fontsize=7)
    return save(fig, out / "projection.png")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.projection", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="h100-sxm", help="device profile (swap.devices.PROFILES)")
    ap.add_argument("--memory", default=None, help="device memory (default: the profile's; --quick: 1GiB)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    import vmalloc

    dev = profile(args.device)
    memory = vmalloc.parse_size(args.memory) if args.memory else (1 * GiB if args.quick else dev.memory)
    costs = for_device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results: dict[str, Any] = {
        "meta": {"command": "python -m bench.projection" + (" --quick" if args.quick else ""),
                 "date": time.strftime("%Y-%m-%d"), "device": dev.name, "memory": memory,
                 "h2d_bandwidth": dev.h2d_bandwidth, "d2h_bandwidth": dev.d2h_bandwidth, "vmm_costs": costs.name,
                 "torch": torch.__version__, "python": platform.python_version()},  # fmt: skip
        "workloads": [],
    }
    for model, size in (QUICK if args.quick else FULL).items():
        results["workloads"].append(run_workload(model, size, dev, memory, costs))
    results["meta"]["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "projection.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "projection.md").write_text(markdown(results))
    png = plot(results, out)
    log(f"wrote {out / 'projection.json'}, {out / 'projection.md'}, {png.name}")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
