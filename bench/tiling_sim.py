"""The setting of SFT (segmented fused-tiled execution, CC'22), simulated: VGG-16 at batch 1 on an 11 GiB RTX 2080 Ti
and on an A100 40 GB, the largest image per strategy and the step time against image size.

    python -m bench.tiling_sim            # both devices (about 5 minutes on 2 shared cores)
    python -m bench.tiling_sim --quick    # one device, three sizes

The training step is captured on the meta device (no memory used, whatever the image) and priced per
operator on the device's roofline (``DeviceProfile.step_seconds``), tiles and their halo recompute
included; the strategies are those of Note [Strategies for one large image] in
swap/tiling/plan/largest.py (PyTorch-Base, checkpointed segments, the swap runtime alone, swap.tiled,
swap.tiled with the segment boundaries swapped to the host). Float32, SGD without momentum (no optimizer
state), the whole device memory as the budget, as SFT ran it.

Writes <out>/tiling_sim.json, tiling_sim.md and tiling_sim.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import torch

from swap.devices import profile
from swap.forecast.zoo import vgg16
from swap.tiling.plan.largest import IMAGE_STRATEGIES, image_graph, largest_images, plan_image
from swap.units import fmt_bytes

from .plotting import pyplot, save

OUT = Path(__file__).parent / "results"
DEVICES = ("rtx2080ti-11gb", "a100-40gb")
SIDES = (1024, 2048, 4096, 8192, 12288, 16384, 20000, 24576)


def log(msg: str) -> None:
    print(f"[tiling_sim] {msg}", file=sys.stderr, flush=True)


def run(devices: tuple[str, ...], sides: tuple[int, ...]) -> dict:
    with torch.device("meta"):
        model = vgg16()
    out: dict = {"model": "vgg16", "batch": 1, "dtype": "float32", "devices": {}}
    for name in devices:
        dev = profile(name)
        budget = dev.memory
        curve = []
        for side in sides:
            graph = image_graph(model, side)
            row = {"side": side}
            for s in IMAGE_STRATEGIES:
                p = plan_image(graph, side, s, budget, dev)
                row[s] = {"fits": p.fits, "peak": p.peak, "seconds": p.seconds if p.fits else None, "plan": p.describe}
            log(f"{name} {side}x{side}: " + ", ".join(
                f"{s} {row[s]['seconds']:.2f}s" if row[s]["fits"] else f"{s} -" for s in IMAGE_STRATEGIES))  # fmt: skip
            curve.append(row)
        found = largest_images(model, budget, dev, progress=lambda m, n=name: log(f"{n}: {m}"))
        largest = {s: (None if p is None else {"side": p.side, "peak": p.peak, "seconds": p.seconds,
                                                 "plan": p.describe}) for s, p in found.items()}  # fmt: skip
        out["devices"][name] = {"budget": budget, "profile": dev.name, "source": dev.source, "curve": curve,
                                "largest": largest}  # fmt: skip
    return out


def plot(res: dict, path: Path) -> Path:
    plt = pyplot()
    names = list(res["devices"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        d = res["devices"][name]
        for s, marker in zip(IMAGE_STRATEGIES, "osD^v"):
            pts = [(r["side"], r[s]["seconds"]) for r in d["curve"] if r[s]["fits"]]
            big = d["largest"][s]
            if big is not None:
                pts.append((big["side"], big["seconds"]))
            pts.sort()
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker + "-", label=f"{s} (max {pts[-1][0]}²)")
        ax.set(xscale="log", yscale="log", xlabel="image side (pixels), VGG-16, batch 1",
               ylabel="predicted step time (s)", title=f"{name} ({fmt_bytes(d['budget'])})")  # fmt: skip
        ax.legend(fontsize=8)
    return save(fig, path)


def markdown(res: dict, cmd: str) -> str:
    lines = ["# Tiled execution, simulated: SFT's setting (VGG-16, batch 1, float32)", "", f"Command: `{cmd}`",
             "", "Predicted on the device roofline from a meta-device capture (swap.tiling.plan); the budget "
             "is the device's memory. Strategies: Note [Strategies for one large image] "
             "(swap/tiling/plan/largest.py).", ""]  # fmt: skip
    for d in res["devices"].values():
        lines += [f"## {d['profile']}", "", f"Figures: {d['source']}.", "", "| strategy | largest image | peak | step "
                  "time at that size | plan |", "|---|---|---|---|---|"]  # fmt: skip
        for s, big in d["largest"].items():
            if big is None:
                lines.append(f"| {s} | none | | | |")
            else:
                lines.append(f"| {s} | {big['side']}² | {fmt_bytes(big['peak'])} | {big['seconds']:.2f} s | "
                             f"{big['plan']} |")  # fmt: skip
        lines += ["", "Step time (s) against image side; - where the strategy does not fit:", "",
                  "| side | " + " | ".join(IMAGE_STRATEGIES) + " |",
                  "|---|" + "---|" * len(IMAGE_STRATEGIES)]  # fmt: skip
        for r in d["curve"]:
            cells = [f"{r[s]['seconds']:.2f}" if r[s]["fits"] else "-" for s in IMAGE_STRATEGIES]
            lines.append(f"| {r['side']}² | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    devices = DEVICES[:1] if args.quick else DEVICES
    sides = (1024, 4096, 8192) if args.quick else SIDES
    res = run(devices, sides)
    cmd = "python -m bench.tiling_sim" + (" --quick" if args.quick else "")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tiling_sim.json").write_text(json.dumps({"command": cmd, **res}, indent=1) + "\n")
    (out / "tiling_sim.md").write_text(markdown(res, cmd))
    log(f"wrote {plot(res, out / 'tiling_sim.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
