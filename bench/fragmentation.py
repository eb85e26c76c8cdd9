"""Fragmentation on training traces: vmalloc beside models of PyTorch's allocator policies.

    python -m bench.fragmentation            # full: 5 workloads x 2 batches, with and without swapping
    python -m bench.fragmentation --quick    # a smoke run (< 3 minutes)

Each workload's training steps are captured on the meta device (bench.traces, swap.capture) and, for the
swapped variant, rewritten with the swap runtime's schedule for a budget (swap.forecast.from_trace.swapped).
Every trace is then replayed on vmalloc (sim backend, 2 MiB chunks), PyTorch's native caching allocator and
its expandable_segments mode (swap.forecast.replay.torch_policy), with unlimited capacity, and measured
(swap.forecast.replay); vmalloc's maps per steady iteration come from bench.vmm_work. Also:
a chunk-size sweep for vmalloc, the largest ResNet-50 batch that fits 16 GiB per allocator with and without
swapping, and a host-backend replay that must give the sim backend's figures.

Writes <out>/fragmentation.json, fragmentation.md and fragmentation_{timeline,utilization,max_batch}.png.
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

import vmalloc
from bench.plotting import pyplot, save
from bench.traces import cached_capture
from bench.vmm_costs import for_device
from swap.capture import Trace, live_peak
from swap.forecast.from_trace import sequence_from_trace, swapped
from swap.forecast.replay import fitting_budget
from swap.forecast.replay.replay import ALLOCATORS, measure

GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[1]

FULL = {
    "resnet50": (256, 1440),
    "densenet121": (64, 256),
    "unet": (8, 32),
    "gpt2": (4, 16),
    "gpt2-bf16": (8, 32),
}
QUICK = {"resnet50": (32,), "unet": (2,)}
SWAP_BUDGET = 16 * GiB  # the V100 of the window-scheduling paper (arXiv 2010.14109)
VMM_DEVICE = "v100-16gb"  # whose driver-call costs price the maps (bench.vmm_costs)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def swap_budget(trace: Trace) -> Optional[int]:
    """16 GiB, or half the no-swap peak when that is below 16 GiB; raised to what the plan can meet."""
    seq = sequence_from_trace(trace)
    floor = seq.step_floor()
    budget = min(SWAP_BUDGET, seq.no_swap_peak() // 2)
    return max(budget, int(floor * 1.05))


# vmalloc's block_size; 2 MiB = one chunk per block, as before blocks; 32 MiB is the default.
BLOCK_SWEEP = ("2MiB", "16MiB", "32MiB", "64MiB", "256MiB")


def steady_vmm(trace: Trace, chunk: str | int = "2MiB") -> dict[str, Any]:
    """vmalloc's map and unmap calls in the last (steady) iteration, the chunks they mapped, and their modelled
    host time: bench.vmm_costs prices map (with its share of set_access), unmap and release per call, and
    creating per chunk (creating clears the pages it hands out: its cost grows with bytes)."""
    c = steady_calls(trace, chunk)
    costs = for_device(VMM_DEVICE, vmalloc.parse_size(chunk))
    seconds = costs.seconds(c["num_maps"], c["num_unmaps"], c["num_created_chunks"], c["num_device_free"])
    return {
        "steady_maps": c["num_maps"],
        "steady_unmaps": c["num_unmaps"],
        "steady_vmm_seconds": seconds,
        "steady_mapped_chunks": c["num_mapped_chunks"],
        "steady_created_chunks": c["num_created_chunks"],
        "peak_slack": c["peak_slack"],
    }


def steady_calls(trace: Trace, chunk: str | int = "2MiB", block: str | int = 0) -> dict[str, int]:
    """vmalloc's driver calls and the chunks they moved in the last iteration (the steady state), with
    block_size ``block`` (0: the default). A run of a block's chunks maps with one call (Note [Blocks and
    slices] in csrc/allocator_blocks.cpp). Also ``held_after_empty_cache``: the free bytes empty_cache could
    not give back at the end of the trace, because their block holds a chunk still in use; and ``peak_slack``:
    the most bytes held beyond the most ever in use (the growth slack, Note [Slack reported apart])."""
    from swap.capture import ALLOC, FREE

    arena = vmalloc.Arena("sim", capacity=4 << 40, chunk_size=chunk, block_size=block)
    begin, end = trace.iterations()[-1]
    ops, ids, sizes, streams = trace.op.tolist(), trace.id.tolist(), trace.size.tolist(), trace.stream.tolist()
    keys = ("num_maps", "num_unmaps", "num_set_access", "num_mapped_chunks", "num_unmapped_chunks",
            "num_device_alloc", "num_created_chunks", "num_device_free")  # fmt: skip
    addr: dict[int, int] = {}
    before: dict[str, int] = {}
    for k in range(end + 1):
        if k == begin:
            before = arena.stats()
        if ops[k] == ALLOC:
            addr[ids[k]] = arena.malloc(sizes[k], streams[k])
        elif ops[k] == FREE and ids[k] in addr:
            arena.free(addr.pop(ids[k]))
    after = arena.stats()
    out = {key: after[key] - before[key] for key in keys}
    out["peak_slack"] = after["slack_bytes.all.peak"]
    arena.empty_cache()
    out["held_after_empty_cache"] = arena.stats()["num_pool_chunks"] * arena.chunk_size
    return out


def run_trace(trace: Trace, label: dict[str, Any], chunk_sweep: list[str],
              block_sweep: bool = False) -> dict[str, Any]:  # fmt: skip
    row = dict(label)
    row["events"] = len(trace)
    row["requested_peak"] = live_peak(trace)
    row["allocators"] = {}
    for name in ALLOCATORS:
        m = measure(trace, name, series_every=max(1, len(trace) // 400))
        m["efficiency"] = row["requested_peak"] / m["peak_reserved"] if m["peak_reserved"] else 1.0
        if name == "vmalloc":
            m.update(steady_vmm(trace))
        row["allocators"][name] = m
    row["chunk_sweep"] = {}
    for chunk in chunk_sweep:
        m = measure(trace, "vmalloc", chunk_size=chunk)
        m["efficiency"] = row["requested_peak"] / m["peak_reserved"]
        m.update(steady_vmm(trace, chunk))
        m.pop("series")
        row["chunk_sweep"][chunk] = m
    if block_sweep:
        row["block_sweep"] = {block: steady_calls(trace, "2MiB", block) for block in BLOCK_SWEEP}
    return row


def fits(model: str, batch: int, steps: int, allocator: str, capacity: int, use_swap: bool) -> bool:
    trace = cached_capture(model, batch, steps)
    if use_swap:
        return fitting_budget(trace, allocator, capacity) is not None
    return measure(trace, allocator, capacity=capacity)["ok"]


def max_batch(model: str, batches: list[int], steps: int, allocator: str, capacity: int, use_swap: bool) -> int:
    """The largest of ``batches`` (ascending) that replays without OOM (binary search: fitting is monotone)."""
    lo, hi, best = 0, len(batches) - 1, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(model, batches[mid], steps, allocator, capacity, use_swap):
            best, lo = batches[mid], mid + 1
        else:
            hi = mid - 1
    return best


def host_cross_check(steps: int) -> dict[str, Any]:
    """The host backend (real memory) and the sim backend give the same figures on one trace."""
    trace = cached_capture("resnet50", 8, steps)
    sim = measure(trace, "vmalloc")
    host = measure(trace, "vmalloc-host", capacity=4 * GiB)
    keys = ["peak_allocated", "peak_reserved", "num_maps", "num_unmaps", "num_reclaims"]
    return {"trace": "resnet50 batch 8", "sim": {k: sim[k] for k in keys}, "host": {k: host[k] for k in keys},
            "equal": all(sim[k] == host[k] for k in keys)}  # fmt: skip


# -- output -------------------------------------------------------------------------------------------------
def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Command: `{results['meta']['command']}` ({results['meta']['date']}, torch {results['meta']['torch']}).",
        "",
        "Utilization = peak active / peak reserved (GMLake); efficiency = peak requested / peak reserved (counts "
        "rounding as waste); steady = allocated / reserved per iteration after the first, averaged (STAlloc). "
        "Unlimited capacity; reserved and requested in GiB. Slack: vmalloc's growth slack, the most GiB held beyond "
        "the most ever in use (stats()['slack_bytes.all.peak'], Note [Slack reported apart]); reserved includes it. "
        "The trade-off by growth_slack: bench/results/fragmentation_slack.md.",
        "",
        "Maps / unmaps: driver calls (cuMemMap / cuMemUnmap; one per run of a physical block's chunks, Note [Blocks "
        "and slices]) over the whole trace (all iterations); per steady iteration: in the last one, with the chunks "
        f"they mapped and their modelled host time (per-call costs of bench.vmm_costs, {VMM_DEVICE}).",
        "",
        "| trace | requested | allocator | reserved | slack | utilization | efficiency | steady | maps / unmaps "
        "| maps / unmaps per steady iteration (chunks mapped) | modelled ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["traces"]:
        name = f"{row['model']} b{row['batch']}" + (f" swap@{gib(row['budget'])}" if row["swapped"] else "")
        for a, m in row["allocators"].items():
            steady = (f"{m['steady_maps']} / {m['steady_unmaps']} ({m['steady_mapped_chunks']}) "
                      f"| {1e3 * m['steady_vmm_seconds']:.0f}" if "steady_maps" in m else "- | -")  # fmt: skip
            slack = gib(m["peak_slack"]) if "peak_slack" in m else "-"
            lines.append(
                f"| {name} | {gib(row['requested_peak'])} | {a} | {gib(m['peak_reserved'])} | {slack} "
                f"| {m['utilization']:.3f} "
                f"| {m['efficiency']:.3f} | {m['steady_utilization']:.3f} | {m['num_maps']} / {m['num_unmaps']} "
                f"| {steady} |"
            )
    lines += ["", "vmalloc chunk-size sweep (utilization / efficiency / map calls per steady iteration, modelled ms):",
              ""]  # fmt: skip
    chunks = list(results["traces"][0]["chunk_sweep"]) if results["traces"] else []
    lines.append("| trace | " + " | ".join(["2MiB"] + chunks) + " |")
    lines.append("|---|" + "---|" * (1 + len(chunks)))
    for row in results["traces"]:
        name = f"{row['model']} b{row['batch']}" + (" swap" if row["swapped"] else "")
        v = row["allocators"]["vmalloc"]
        cells = [
            f"{m['utilization']:.3f} / {m['efficiency']:.3f} / {m['steady_maps']}, {1e3 * m['steady_vmm_seconds']:.0f}"
            for m in [v, *row["chunk_sweep"].values()]
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    swept = [r for r in results["traces"] if "block_sweep" in r]
    if swept:
        lines += ["", "vmalloc block-size sweep at 2 MiB chunks, swapped traces: map / unmap calls per steady "
                  "iteration, and the free MiB that empty_cache cannot give back at the end of the trace (their "
                  "block holds a chunk in use; memory is released in whole blocks). block_size 2MiB is one chunk "
                  f"per block, vmalloc before blocks; the default is {vmalloc.Arena('sim').stats()['block_size'] >> 20}"
                  "MiB (the first table).", "",
                  "| trace | " + " | ".join(BLOCK_SWEEP) + " |", "|---|" + "---|" * len(BLOCK_SWEEP)]  # fmt: skip
        for row in swept:
            cells = [f"{c['num_maps']} / {c['num_unmaps']}, {c['held_after_empty_cache'] >> 20}"
                     for c in row["block_sweep"].values()]  # fmt: skip
            lines.append(f"| {row['model']} b{row['batch']} swap | " + " | ".join(cells) + " |")
    mb = results.get("max_batch")
    if mb:
        lines += [
            "",
            f"Largest {mb['model']} batch whose trace replays within {gib(mb['capacity'])} GiB "
            f"(candidates {mb['batches']}):",
            "",
            "| allocator | no swap | with swap |",
            "|---|---|---|",
        ]
        for a in ALLOCATORS:
            lines.append(f"| {a} | {mb['no_swap'][a]} | {mb['swap'][a]} |")
    hc = results.get("host_check")
    if hc:
        lines += ["", f"Host backend vs sim backend on {hc['trace']}: identical figures: {hc['equal']}."]
    return "\n".join(lines) + "\n"


def plots(results: dict[str, Any], out: Path) -> list[Path]:
    plt = pyplot()

    written = []
    swap_rows = [r for r in results["traces"] if r["swapped"]]
    if swap_rows:
        row = max(swap_rows, key=lambda r: r["requested_peak"])
        fig, ax = plt.subplots(figsize=(9, 4.5))
        first = True
        for a, m in row["allocators"].items():
            xs = [p[0] for p in m["series"]]
            if first:
                ax.plot(xs, [p[1] / GiB for p in m["series"]], color="black", lw=1, label="requested (live tensors)")
                first = False
            ax.plot(xs, [p[2] / GiB for p in m["series"]], lw=1.3, label=f"reserved: {a}")
        ax.axhline(row["budget"] / GiB, color="grey", ls="--", lw=0.8, label="swap budget")
        ax.set_xlabel("trace event")
        ax.set_ylabel("GiB")
        ax.set_title(f"{row['model']} batch {row['batch']} under swapping: reserved vs requested")
        ax.legend(fontsize=8)
        written.append(save(fig, out / "fragmentation_timeline.png"))
    rows = results["traces"]
    if rows:
        fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4.5))
        width = 0.8 / len(ALLOCATORS)
        for j, a in enumerate(ALLOCATORS):
            ax.bar([i + j * width for i in range(len(rows))], [r["allocators"][a]["utilization"] for r in rows],
                   width, label=a)  # fmt: skip
        ax.set_xticks([i + width for i in range(len(rows))])
        ax.set_xticklabels([f"{r['model']}\nb{r['batch']}{' swap' if r['swapped'] else ''}" for r in rows], fontsize=7)
        ax.set_ylim(0.5, 1.01)
        ax.set_ylabel("peak active / peak reserved")
        ax.set_title("Utilization per trace (GMLake's metric)")
        ax.legend(fontsize=8, loc="lower left")
        written.append(save(fig, out / "fragmentation_utilization.png"))
    swept = [r for r in results["traces"] if "block_sweep" in r]
    if swept:
        fig, ax = plt.subplots(figsize=(max(7, len(swept) * 1.3), 4.5))
        bars = [
            ("2 MiB chunks, one per block (before)", [r["block_sweep"]["2MiB"]["num_maps"] for r in swept]),
            ("2 MiB chunks in blocks (default)", [r["allocators"]["vmalloc"]["steady_maps"] for r in swept]),
        ]
        if all("8MiB" in r["chunk_sweep"] for r in swept):
            bars.append(("8 MiB chunks in blocks", [r["chunk_sweep"]["8MiB"]["steady_maps"] for r in swept]))
        width = 0.8 / len(bars)
        for j, (label, values) in enumerate(bars):
            ax.bar([i + j * width for i in range(len(swept))], [max(v, 0.5) for v in values], width, label=label)
        ax.set_yscale("log")
        ax.set_xticks([i + width * (len(bars) - 1) / 2 for i in range(len(swept))])
        ax.set_xticklabels([f"{r['model']}\nb{r['batch']} swap" for r in swept], fontsize=7)
        ax.set_ylabel("cuMemMap calls per steady iteration")
        ax.set_title("vmalloc's mapping work: chunks in blocks, one call per run")
        ax.legend(fontsize=8)
        written.append(save(fig, out / "fragmentation_map_calls.png"))
    mb = results.get("max_batch")
    if mb:
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = range(len(ALLOCATORS))
        ax.bar([x - 0.2 for x in xs], [mb["no_swap"][a] for a in ALLOCATORS], 0.4, label="no swap")
        ax.bar([x + 0.2 for x in xs], [mb["swap"][a] for a in ALLOCATORS], 0.4, label="window swap")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(ALLOCATORS)
        ax.set_ylabel("largest batch")
        ax.set_title(f"{mb['model']}: largest batch within {mb['capacity'] / GiB:.0f} GiB")
        ax.legend()
        written.append(save(fig, out / "fragmentation_max_batch.png"))
    return written


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fragmentation", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="small workloads: a smoke run in under 3 minutes")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workloads = QUICK if args.quick else FULL
    steps = 2 if args.quick else 3
    chunk_sweep = ["20MiB"] if args.quick else ["4MiB", "8MiB", "20MiB"]
    t_start = time.perf_counter()
    results: dict[str, Any] = {
        "meta": {
            "command": "python -m bench.fragmentation" + (" --quick" if args.quick else ""),
            "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "steps": steps,
            "swap_budget_rule": "min(16 GiB, no-swap peak / 2)",
        },  # fmt: skip
        "traces": [],
    }
    for model, batches in workloads.items():
        for batch in batches:
            trace = cached_capture(model, batch, steps)
            base = {"model": model, "batch": batch, "dtype": trace.meta.get("dtype"), "size": trace.meta.get("size")}
            results["traces"].append(run_trace(trace, {**base, "swapped": False, "budget": None}, chunk_sweep))
            budget = swap_budget(trace)
            st = swapped(trace, budget)
            results["traces"].append(run_trace(st, {**base, "swapped": True, "budget": budget}, chunk_sweep, True))
            v = results["traces"][-2]["allocators"]["vmalloc"]
            w = results["traces"][-1]["allocators"]["vmalloc"]
            log(f"{model} batch {batch}: vmalloc utilization {v['utilization']:.3f}, swapped (budget "
                f"{budget / GiB:.1f} GiB) {w['utilization']:.3f}  [{time.perf_counter() - t_start:.0f} s]")  # fmt: skip
    if args.quick:
        mb_model, mb_batches, capacity = "resnet50", [16, 32, 64, 128], 4 * GiB
    else:
        mb_model, capacity = "resnet50", 16 * GiB
        mb_batches = [64, 128, 190, 256, 384, 512, 640, 768, 928, 1120, 1248, 1440, 1600, 1800, 2048]
    log(f"largest {mb_model} batch within {capacity / GiB:.0f} GiB ...")
    results["max_batch"] = {"model": mb_model, "capacity": capacity, "batches": mb_batches, "no_swap": {}, "swap": {}}
    for a in ALLOCATORS:
        for use_swap, key in ((False, "no_swap"), (True, "swap")):
            results["max_batch"][key][a] = max_batch(mb_model, mb_batches, 2, a, capacity, use_swap)
        log(f"  {a}: {results['max_batch']['no_swap'][a]} without swapping, {results['max_batch']['swap'][a]} with")
    results["host_check"] = host_cross_check(steps)
    results["meta"]["seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "fragmentation.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "fragmentation.md").write_text(markdown(results))
    written = plots(results, out)
    log(f"wrote {out / 'fragmentation.json'}, {out / 'fragmentation.md'}, " + ", ".join(p.name for p in written))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
