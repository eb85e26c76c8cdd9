"""The strategies of ``swap.plan`` as a text table and a figure (Note [Strategies from one capture])."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

from ..units import fmt_size as fmt_bytes
from .strategies import StrategyResult

PLOT_EXTRA = "pip install 'vmalloc-swap[plot]' (or pip install matplotlib)"


def pyplot() -> Any:
    """matplotlib's pyplot on a file backend, or an ImportError that says how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(f"plotting needs matplotlib, which is not installed: {PLOT_EXTRA}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _speed(p: Any) -> str:
    return f"{p.samples_per_s:.4g}" if p is not None and p.fits and p.samples_per_s else "-"


def table(results: dict[str, StrategyResult], batch: Optional[int] = None, policies: Optional[dict[str, Any]] = None,
          allocator: str = "the allocator") -> str:  # fmt: skip
    """One row per strategy: largest batch, samples/s there and at ``batch``, and what it costs there. With
    ``policies`` (policy -> its result, replayed on ``allocator``), a strategy named after a policy whose largest
    batch differs from the policy's says so: the two are found on different allocators."""
    if not results:
        return ""
    at = f"at batch {batch}" if batch else ""
    lines = ["strategies: whole keep / swap / recompute plans, planned on the ideal allocator (no fragmentation, "
             "no VMM mapping costs)",
             f"{'strategy':<20}{'largest batch':>14}{'samples/s':>11}" + (f"{at:>16}" if at else "")
             + f"{'planned peak':>14}{'recomputed':>12}{'copied':>12}  plan at the largest batch"]  # fmt: skip
    plain = results.get("none")
    for name, r in results.items():
        p = r.at_max
        row = f"{name:<20}{r.max_batch or 'none fits':>14}{_speed(p):>11}"
        if at:
            row += f"{_speed(r.at(batch)):>16}"
        fits = p is not None and p.fits
        row += (f"{fmt_bytes(p.peak) if fits else '-':>14}{fmt_bytes(p.recomputed_bytes) if fits else '-':>12}"
                f"{fmt_bytes(p.copied_bytes) if fits else '-':>12}  {p.plan if fits else ''}")  # fmt: skip
        lines.append(row)
    ideal = "recomputed and copied: bytes per step"
    if plain is not None and plain.max_batch:
        ideal += f"; {plain.max_batch} fits without swapping or recomputing (on the ideal allocator)"
    lines.append(ideal)
    differ = [f"{name} {p.max_batch} vs {results[name].max_batch}" for name, p in (policies or {}).items()
              if name in results and results[name].max_batch != p.max_batch]  # fmt: skip
    if differ:
        lines.append(f"largest batch as a policy (its run replayed on {allocator}) vs as a strategy (on the ideal "
                     f"allocator): {', '.join(differ)}")  # fmt: skip
    auto = results.get("auto")
    if auto is not None and auto.blocker:
        lines.append(f"auto (on the ideal allocator), past batch {auto.max_batch}: {auto.blocker}")
    return "\n".join(lines)


def draw(ax: Any, results: dict[str, StrategyResult], title: str) -> None:
    """samples/s against batch on ``ax``: one line per strategy through the batches compared where it fits, the
    joint strategy in bold, the largest batch without swapping dotted."""
    for name, r in results.items():
        pts = sorted((n, p.samples_per_s) for n, p in r.points.items() if p.fits and p.samples_per_s)
        if not pts:
            continue
        style = {"lw": 2.4, "color": "black", "zorder": 5} if name == "auto" else {"lw": 1.2}
        ax.plot([n for n, _ in pts], [s for _, s in pts], marker="o", ms=3.5, label=name, **style)
    plain = results.get("none")
    if plain is not None and plain.max_batch:
        ax.axvline(plain.max_batch, color="grey", ls=":", lw=0.8)
    ax.set_xlabel("batch size")
    ax.set_ylabel("samples/s (simulated)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)


def plot(results: dict[str, StrategyResult], path: Union[str, Path], title: str) -> Path:
    """A PNG of ``draw``."""
    plt = pyplot()
    path = Path(path)
    fig, ax = plt.subplots(figsize=(9, 5))
    draw(ax, results, title)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
