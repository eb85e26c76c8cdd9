"""What every GPU benchmark shares: the device's description, where results go, writing them (JSON +
Markdown + PNG, each naming the device, driver, torch and command), time boxes, and percentiles."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "gpu"
MiB = 1 << 20


class NoGpu(SystemExit):
    """Raised (exit status 2) by ``require_gpu`` on a machine without a usable CUDA device."""


def require_gpu() -> None:
    """Stops at once, with a line saying why, unless torch sees a CUDA device."""
    try:
        import torch

        ok = torch.cuda.is_available()
        why = f"torch {torch.__version__} sees no CUDA device" + ("" if torch.version.cuda else " (a CPU build)")
    except Exception as e:  # noqa: BLE001 - any import or driver failure means no GPU here
        ok, why = False, f"torch cannot be used: {e}"
    if not ok:
        print(f"make gpu: no NVIDIA GPU available: {why}. Run it on a machine with a GPU and a CUDA build of torch.",
              file=sys.stderr)  # fmt: skip
        raise NoGpu(2)


def slug(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z.-]+", "_", name).strip("_") or "unknown"


def driver_version() -> Optional[str]:
    try:
        from cuda.bindings import driver

        err, v = driver.cuDriverGetVersion()
        if int(err) == 0:
            cuda_api = f"{v // 1000}.{v % 1000 // 10}"
        else:
            cuda_api = None
    except Exception:  # noqa: BLE001
        cuda_api = None
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        smi = []
    parts = [f"driver {smi[0]}" if smi else None, f"CUDA driver API {cuda_api}" if cuda_api else None]
    return ", ".join(p for p in parts if p) or None


def git_commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict[str, Any]:
    """The device, driver, torch and command a result was measured with."""
    import torch

    env: dict[str, Any] = {
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "git_commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, device_memory_bytes=p.total_memory, multiprocessors=p.multi_processor_count,
                   driver=driver_version())  # fmt: skip
    else:
        env.update(device="cpu (no CUDA device)", driver=None)
    return env


def results_dir(env: dict[str, Any], root: Path = RESULTS) -> Path:
    d = root / slug(env["device"])
    d.mkdir(parents=True, exist_ok=True)
    return d


def header_lines(env: dict[str, Any]) -> list[str]:
    return [
        f"- device: {env['device']} ({env.get('driver') or 'driver unknown'})",
        f"- torch {env['torch']} (CUDA {env['torch_cuda']}), Python {env['python']}, commit {env['git_commit']}",
        f"- command: `{env['command']}`",
        f"- measured {env['date']}",
    ]


def write(name: str, title: str, data: dict[str, Any], table: list[str], env: dict[str, Any],
          figure: Any = None, root: Path = RESULTS, notes: Optional[list[str]] = None) -> Path:  # fmt: skip
    """Writes ``<name>.json`` and ``<name>.md`` (and ``<name>.png`` if a figure is given) under the device's
    results directory; returns the directory. Called again as parts complete, so a timeout keeps data."""
    d = results_dir(env, root)
    (d / f"{name}.json").write_text(json.dumps({"environment": env, **data}, indent=1, default=str) + "\n")
    lines = [f"# {title}", "", *header_lines(env), "", *table, ""]
    if notes:
        lines += [*notes, ""]
    if figure is not None:
        figure.suptitle(f"{title}\n{env['device']}, torch {env['torch']}, {env.get('driver') or ''}", fontsize=9)
        figure.savefig(d / f"{name}.png", dpi=110, bbox_inches="tight")
        lines.append(f"![{title}]({name}.png)")
        import matplotlib.pyplot as plt

        plt.close(figure)
    (d / f"{name}.md").write_text("\n".join(lines) + "\n")
    return d


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; values need not be sorted."""
    if not values:
        raise ValueError("percentile of no values")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class TimeBox:
    """A deadline: ``left()`` seconds remain; ``expired()`` once past it. Benchmarks check it between
    measurements and write what they have."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def expired(self) -> bool:
        return self.left() <= 0


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A Markdown table."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return out
