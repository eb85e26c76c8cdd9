"""Runs the GPU benchmarks (``make gpu-bench``), each part in its own process within its time box, and
writes an index of the results under bench/results/gpu/<device>/.

    python -m bench.gpu.run [--parts vmm pinned replay training] [--check]

``--check`` only says whether a GPU is usable (exit 0) or not (exit 2, with the reason): ``make gpu``'s
first step.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import Optional

from bench.gpu import common

# part -> (module, time box in seconds given to it). About 11 minutes in all on an H100.
PARTS = {
    "vmm": ("bench.gpu.vmm_latency", 45),
    "pinned": ("bench.gpu.pinned_bandwidth", 60),
    "replay": ("bench.gpu.allocator_replay", 180),
    "training": ("bench.gpu.training", 360),
}
MARGIN_S = 60  # for start-up and writing, beyond a part's own time box


def command(part: str, scale: float = 1.0) -> list[str]:
    module, seconds = PARTS[part]
    return [sys.executable, "-m", module, "--seconds", f"{seconds * scale:.0f}"]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    p.add_argument("--scale", type=float, default=1.0, help="multiply every time box (e.g. 0.5 for a quick run)")
    p.add_argument("--check", action="store_true", help="only check that a GPU is usable")
    args = p.parse_args(argv)
    common.require_gpu()
    if args.check:
        import torch

        print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
        return 0
    env = common.environment()
    status = []
    for part in args.parts:
        cmd = command(part, args.scale)
        t0 = time.monotonic()
        print(f"gpu-bench: {part}: {' '.join(cmd[1:])}", flush=True)
        try:
            rc = subprocess.run(cmd, cwd=common.ROOT, timeout=PARTS[part][1] * args.scale + MARGIN_S).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        status.append([part, rc, f"{time.monotonic() - t0:.0f} s", f"[{part}]({PARTS[part][0].split('.')[-1]}.md)"])
        print(f"gpu-bench: {part} finished ({rc}) in {time.monotonic() - t0:.0f} s", flush=True)
    # Parts run by an earlier command (make gpu-bench split over two device commands) stay in the index.
    previous = common.results_dir(env) / "index.json"
    if previous.exists():
        import json

        ran = {s[0] for s in status}
        status = [s for s in json.loads(previous.read_text()).get("parts", []) if s[0] not in ran] + status
    d = common.write("index", "GPU benchmarks", {"parts": status},
                     common.table(["part", "exit", "time", "results"], status), env)  # fmt: skip
    print(f"gpu-bench: results in {d}")
    return 0 if all(s[1] == 0 for s in status if s[0] in args.parts) else 1


if __name__ == "__main__":
    sys.exit(main())
