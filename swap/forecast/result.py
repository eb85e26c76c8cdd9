"""``swap.Plan``: what ``swap.plan`` found, as fields, a text table and a figure."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from ..devices import DeviceProfile
from ..units import fmt_exact
from ..units import fmt_size as fmt_bytes  # one byte formatter for the tables
from .offload_report import OffloadForecast
from .strategies import StrategyResult
from .strategy_report import plot as plot_strategies
from .strategy_report import pyplot
from .strategy_report import table as strategy_table


def fmt_seconds(t: Optional[float]) -> str:
    if t is None:
        return "-"
    return f"{t:.2f} s" if t >= 1 else f"{t * 1e3:.1f} ms" if t >= 1e-3 else f"{t * 1e6:.0f} us"


@dataclass
class PolicyResult:
    """One policy at its largest batch."""

    policy: str
    max_batch: int  # 0: not even one sample fits
    samples_per_s: Optional[float] = None
    step_time: Optional[float] = None  # seconds per training step (simulated)
    stall_time: Optional[float] = None  # of which the compute stream waits for copies
    peak: Optional[int] = None  # planned device bytes at the peak
    plan_budget: Optional[int] = None  # the budget the schedule was made for (lowered for the allocator)
    swapped_bytes: int = 0  # device-to-host bytes per step
    window: Optional[int] = None
    trials: int = 0  # batch sizes evaluated


@dataclass
class Plan:
    """The largest batch per policy that fits ``budget`` on ``device``, and its predicted speed.

    Attributes:
        max_batch: policy ("none", "window", "fixed_distance", "all") -> largest batch that fits.
        throughput: policy -> predicted samples/s at that batch (None where nothing fits).
        window: the window (bytes) the window policy chose at its largest batch.
        policies: policy -> ``PolicyResult`` with the step time, stall, planned peak and swapped bytes.
        memory: one step of the window policy's largest batch: device bytes per access step, unswapped and
            swapped (what ``plot`` draws).
        linear: the trace was scaled from small captures (Note [Linear traces]); False: captured per batch.
        strategies: strategy (each baseline of swap.joint.search, and "auto") -> ``StrategyResult``: its
            largest batch, and per batch compared its samples/s, planned peak, bytes recomputed and copied
            (Note [Strategies from one capture]).
        batch: the batch the strategies were also compared at (``swap.plan(batch=...)``), if any.
        min_budget: when no batch fits (``fits_nothing``): the smallest budget in which batch 1 fits under one of
            the policies, replayed on the allocator (to within 1/256); None when not even the device's memory
            holds it, or when something fits.
        min_budget_policy: the policy that fits batch 1 at ``min_budget``.

    The policies' largest batches replay the swapped run on ``allocator`` (its fragmentation and rounding
    counted); the strategies' are planned on the ideal allocator, to compare plans, not allocators. A swap-only
    strategy named after a policy can therefore fit a larger batch than that policy: the table labels both
    (Note [Strategies from one capture]).
        model_state: with ``swap.plan(model_state=..., host=...)``, the offload schedules at ``batch``
            (``swap.forecast.offload_report.OffloadForecast``: tokens/s, placements, host bytes, what binds).
    """

    model: str
    budget: int
    device: DeviceProfile
    allocator: Optional[str]
    policies: dict[str, PolicyResult]
    max_batch: dict[str, int] = field(default_factory=dict)
    throughput: dict[str, Optional[float]] = field(default_factory=dict)
    window: Optional[int] = None
    memory: dict[str, Any] = field(default_factory=dict)
    linear: bool = False
    captures: list[int] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    strategies: dict[str, StrategyResult] = field(default_factory=dict)
    batch: Optional[int] = None
    min_budget: Optional[int] = None
    min_budget_policy: str = ""
    model_state: Optional[OffloadForecast] = None

    def __post_init__(self) -> None:
        self.max_batch = {p: r.max_batch for p, r in self.policies.items()}
        self.throughput = {p: r.samples_per_s for p, r in self.policies.items()}
        w = self.policies.get("window")
        self.window = w.window if w is not None else None

    @property
    def fits_nothing(self) -> bool:
        """Not even batch 1 fits, under any policy or strategy planned."""
        results = [*self.policies.values(), *self.strategies.values()]
        return bool(results) and not any(r.max_batch for r in results)

    @property
    def offload_fits(self) -> bool:
        """Model-state offload was forecast (``model_state``) and ours fits: a way to train when nothing else fits."""
        ours = self.model_state.results.get("ours") if self.model_state is not None else None
        return ours is not None and ours.fits

    @property
    def allocator_name(self) -> str:
        return self.allocator or "the ideal allocator (no fragmentation)"

    def table(self) -> str:
        lines = [
            f"{self.model} on {self.device.name}: budget {fmt_bytes(self.budget)}, allocator {self.allocator_name}",
            "swap policies: " + (f"each swapped run replayed on {self.allocator}" if self.allocator
                                 else "planned on the ideal allocator (no fragmentation)"),
            f"{'policy':<16}{'largest batch':>14}{'samples/s':>12}{'step time':>12}{'stall':>10}"
            f"{'planned peak':>14}{'swapped/step':>15}",
        ]
        for p, r in self.policies.items():
            speed = f"{r.samples_per_s:.4g}" if r.samples_per_s else "-"
            step, stall = fmt_seconds(r.step_time), fmt_seconds(r.stall_time)
            swapped = fmt_bytes(r.swapped_bytes) if r.swapped_bytes else "-"
            lines.append(
                f"{p:<16}{r.max_batch or 'none fits':>14}{speed:>12}{step:>12}{stall:>10}{fmt_bytes(r.peak):>14}"
                f"{swapped:>15}"
            )
        how = "scaled from captures at batches" if self.linear else "captured at batches"
        lines.append(
            f"window {fmt_bytes(self.window)}; trace {how} {', '.join(map(str, sorted(self.captures)))}; "
            f"planned in {self.seconds:.1f} s"
        )
        lines += [f"note: {n}" for n in self.notes]
        if self.strategies:
            lines += ["", strategy_table(self.strategies, self.batch, self.policies, self.allocator_name)]
        if self.fits_nothing:
            lines.append(self.nothing_fits())
            lines += ["", strategy_table(self.strategies, self.batch)]
        if self.model_state is not None:
            lines += ["", "model state under the budget:", self.model_state.table()]
        return "\n".join(lines)

    def nothing_fits(self) -> str:
        """Why no batch fits, and the smallest budget that does (``min_budget``), in words."""
        said = f"nothing fits a budget of {fmt_bytes(self.budget)}: "
        if self.min_budget is None:
            return said + (f"batch 1 does not fit in all of the device's memory ({fmt_bytes(self.device.memory)}) "
                           f"under any policy planned, on {self.allocator_name}")  # fmt: skip
        return said + (f"batch 1 fits from a budget of {fmt_exact(self.min_budget)}, under policy "
                       f"{self.min_budget_policy!r} on {self.allocator_name}")  # fmt: skip

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        ms, self.model_state = self.model_state, None  # its simulations are not plain data: its own to_dict
        try:
            d = asdict(self)
        finally:
            self.model_state = ms
        d["device"] = asdict(self.device)
        d["strategies_allocator"] = None  # the strategies are planned on the ideal allocator, the policies on this
        d["model_state"] = ms.to_dict() if ms is not None else None
        return d

    def plot(self, path: Union[str, Path]) -> Path:
        """A PNG of device memory over one training step at the window policy's largest batch: without
        swapping against swapped, with the budget line."""
        if not self.memory:
            raise ValueError("nothing to plot: no batch fits the budget with the window policy")
        plt = pyplot()

        path = Path(path)
        gib = float(1 << 30)
        m = self.memory
        steps = range(len(m["unswapped"]))
        fig, ax = plt.subplots(figsize=(9, 4.5))
        ax.plot(steps, [v / gib for v in m["unswapped"]], color="tab:red", lw=1.2, label="without swapping")
        ax.plot(steps, [v / gib for v in m["swapped"]], color="tab:blue", lw=1.2,
                label=f"window policy (window {fmt_bytes(self.window)})")  # fmt: skip
        ax.axhline(self.budget / gib, color="black", ls="--", lw=0.9, label=f"budget {fmt_bytes(self.budget)}")
        if m.get("backward_starts"):
            ax.axvline(m["backward_starts"], color="grey", ls=":", lw=0.8)
            ax.text(m["backward_starts"], ax.get_ylim()[1] * 0.97, " backward", color="grey", fontsize=8, va="top")
        ax.set_xlabel("access step (a save or a use of a saved activation)")
        ax.set_ylabel("device memory (GiB)")
        ax.set_title(f"{self.model}, batch {m['batch']}: one training step on {self.device.name}", fontsize=10)
        ax.legend(fontsize=8, loc="upper left")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def plot_strategies(self, path: Union[str, Path]) -> Path:
        """A PNG of samples/s against batch, one line per strategy (Note [Strategies from one capture])."""
        if not self.strategies:
            raise ValueError("nothing to plot: no strategy was compared (swap.plan(strategies=()) ?)")
        title = f"{self.model} on {self.device.name}, budget {fmt_bytes(self.budget)} (simulated)"
        return plot_strategies(self.strategies, path, title)
