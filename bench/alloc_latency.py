"""Cached-path latency of malloc+free pairs: vmalloc's host backend, in a C++ loop and through Python,
against the system malloc.

    python -m bench.alloc_latency [--samples N]

Writes bench/results/alloc_latency.json and .md.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import vmalloc

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BATCH = 100


def cpp_binary() -> Path:
    candidates = sorted((ROOT / "build").glob("cmake-*/alloc_latency"))
    if not candidates:
        sys.exit("alloc_latency is not built: run `make setup` (pip install -e . builds it with the extension)")
    return candidates[0]


def python_loop(size: int, samples: int) -> dict:
    arena = vmalloc.Arena("host", capacity="256MiB")
    malloc, free = arena.malloc, arena.free
    free(malloc(size))
    ns = []
    for _ in range(samples):
        t0 = time.perf_counter_ns()
        for _ in range(BATCH):
            free(malloc(size))
        ns.append((time.perf_counter_ns() - t0) / BATCH)
    ns.sort()
    q = lambda p: round(ns[int(p * (len(ns) - 1))], 1)  # noqa: E731
    return {
        "allocator": "vmalloc_python",
        "size": size,
        "pairs": samples * BATCH,
        "p50_ns": q(0.5),
        "p90_ns": q(0.9),
        "p99_ns": q(0.99),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=20000, help="batches of 100 pairs per (allocator, size)")
    args = ap.parse_args()
    print(f"C++ loop: {cpp_binary()}", flush=True)
    out = subprocess.run([str(cpp_binary()), str(args.samples)], check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    print("Python loop ...", flush=True)
    for size in sorted({r["size"] for r in rows}):
        rows.append(python_loop(size, max(1, args.samples // 10)))
    meta = {
        "command": f"python -m bench.alloc_latency --samples {args.samples}",
        "machine": platform.processor() or platform.machine(),
        "cpus": __import__("os").cpu_count(),
        "python": platform.python_version(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "alloc_latency.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = ["| allocator | size | p50 ns | p90 ns | p99 ns |", "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["size"], r["allocator"])):
        lines.append(f"| {r['allocator']} | {r['size']} | {r['p50_ns']} | {r['p90_ns']} | {r['p99_ns']} |")
    table = "\n".join(lines)
    (RESULTS / "alloc_latency.md").write_text(
        f"`{meta['command']}` ({meta['machine']}, {meta['cpus']} CPUs)\n\n{table}\n"
    )
    print(table)


if __name__ == "__main__":
    main()
