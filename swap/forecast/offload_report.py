"""What ``forecast_offload`` found (swap/forecast/offload.py), as fields, a text table and plain data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ..schedule.model_state import Bucket, ModelStatePlan, ModelStateSim, Placement
from ..units import fmt_size


@dataclass
class OffloadResult:
    """One schedule at one batch: whether it fits and how fast it runs (simulated).

    Attributes:
        schedule, label: the schedule's name (``swap.forecast.offload.SCHEDULES``) and what it stands for.
        fits: whether it fits the device budget and the host's memory; ``why`` not, when not.
        tokens_per_s, step_time: its simulated speed.
        sim: the simulated step (``ModelStateSim``: stalls, bytes each way, host seconds, bound).
        plan: where every bucket lives and is updated.
        activations: the activation plan the joint search chose beside it.
        device_peak: planned device bytes at the peak, activations and model state.
        host_bytes, pinned_bytes: host bytes, model state and swapped activations; the pinned part.
        room: device bytes kept for model state while the activations were planned.
        clipping: how the schedule's system clips gradients.
        timing: when its host steps run ("blocking", "before_use", "speculative").
        kernel: the host optimizer's kernel it is priced with (``swap.devices.KERNELS``).
        format: the bytes it keeps each role in (``StateFormat.describe``).
        buckets: the buckets the plan places (ours: packed as the runtime packs the model, Note [One packer]).
    """

    schedule: str
    label: str
    fits: bool
    why: str = ""
    tokens_per_s: Optional[float] = None
    step_time: Optional[float] = None
    sim: Optional[ModelStateSim] = None
    plan: Optional[ModelStatePlan] = None
    activations: str = ""
    device_peak: int = 0
    host_bytes: int = 0
    pinned_bytes: int = 0
    room: int = 0
    clipping: str = ""
    timing: str = ""
    kernel: str = ""
    format: str = ""
    buckets: list[Bucket] = field(default_factory=list)

    def placements(self) -> str:
        """resident/host-master/streamed bucket counts."""
        if self.plan is None:
            return "-"
        counts = {p: self.plan.placements.count(p) for p in Placement}
        return "/".join(str(counts[p]) for p in Placement)

    def to_dict(self) -> dict[str, Any]:
        s = self.sim
        d: dict[str, Any] = {
            "schedule": self.schedule, "label": self.label, "fits": self.fits, "why": self.why,
            "tokens_per_s": self.tokens_per_s, "step_time": self.step_time, "activations": self.activations,
            "device_peak": self.device_peak, "host_bytes": self.host_bytes, "pinned_bytes": self.pinned_bytes,
            "room": self.room, "clipping": self.clipping, "timing": self.timing, "kernel": self.kernel,
            "format": self.format,
            "placements": self.placements(),
        }  # fmt: skip
        if self.plan is not None:
            d["speculate"], d["staging_slots"] = self.plan.speculate, self.plan.staging_slots
        if s is not None:
            d.update({
                "compute_time": s.compute_time, "stall_time": s.stall_time, "stalls": s.stalls,
                "h2d_bytes": s.h2d_bytes, "d2h_bytes": s.d2h_bytes, "host_seconds": s.host_seconds,
                "host_exposed": s.host_exposed, "lower_bound": s.lower_bound, "bound": s.bound,
                "bytes_by_kind": s.bytes_by_kind, "speculated": s.speculated,
            })  # fmt: skip
        return d


@dataclass
class OffloadForecast:
    """``forecast_offload``'s result: every schedule at one batch (Note [Offload schedules side by side])."""

    model: str
    batch: int
    tokens: int  # per step
    budget: int
    device: str
    host: str
    format: str
    params: int
    compute_seconds: float  # the step's compute without recompute or model state: the compute bound
    host_memory: int = 0
    results: dict[str, OffloadResult] = field(default_factory=dict)

    def bound(self, name: str) -> Optional[float]:
        """max(compute, link, host-optimizer) seconds for schedule ``name``: the compute without recompute
        (``compute_seconds``), each direction's bytes over its bandwidth, and the host steps' seconds."""
        r = self.results.get(name)
        if r is None or r.sim is None:
            return None
        s = r.sim
        return max(self.compute_seconds, s.lower_bound if s.bound != "compute" else 0.0)

    def share_of_bound(self, name: str) -> Optional[float]:
        """Tokens/s of ``name`` over the tokens/s its bound allows (1.0: nothing exposed, no recompute)."""
        b, r = self.bound(name), self.results.get(name)
        return b / r.step_time if b and r is not None and r.step_time else None

    def ratio(self, name: str, other: str) -> Optional[float]:
        """Tokens/s of ``name`` over ``other``'s; infinite where only ``name`` fits, None where it does not."""
        a, b = self.results.get(name), self.results.get(other)
        if a is None or not a.fits or not a.tokens_per_s:
            return None
        if b is None or not b.fits or not b.tokens_per_s:
            return float("inf")
        return a.tokens_per_s / b.tokens_per_s

    def table(self) -> str:
        lines = [
            f"{self.model} ({self.params / 1e9:.2f} B parameters; {self.format}), batch {self.batch} "
            f"({self.tokens} tokens a step) on {self.device} with {self.host}: budget {fmt_size(self.budget)} "
            f"(simulated)",
            f"{'schedule':<28}{'tokens/s':>10}{'step':>9}{'bound':>14}{'host step':>11}{'exposed':>9}"
            f"{'R/H/S':>11}{'device':>11}{'host mem':>11}  {'host steps':<12}{'host kernel':<12}clipping",
        ]  # fmt: skip
        for r in self.results.values():
            if not r.fits:
                lines.append(f"{r.label:<28}{'does not fit':>10}  {r.why}")
                continue
            s = r.sim
            assert s is not None and r.step_time is not None
            lines.append(
                f"{r.label:<28}{r.tokens_per_s:>10.0f}{r.step_time:>8.2f}s{s.bound:>8} {s.lower_bound:>4.2f}s"
                f"{s.host_seconds:>10.2f}s{s.host_exposed:>8.2f}s{r.placements():>11}{fmt_size(r.device_peak):>11}"
                f"{r.host_bytes / 1e9:>8.0f} GB  {r.timing:<12}{r.kernel:<12}{r.clipping}"
            )  # fmt: skip
        lines.append("R/H/S: buckets resident / host master / streamed; exposed: seconds the step waited on host "
                     "steps; bound: the largest of compute, link and host-step seconds; host steps: blocking (after "
                     "the backward, the next iteration waits for all), before_use (after opt.step(), each bucket's "
                     "next use waits for its own) or speculative (in the backward, where the runtime's rollback "
                     "copies fit the host's memory: their copy priced, a failed speculation not)")  # fmt: skip
        lines += [f"{r.label}: {r.format}" for r in self.results.values() if r.format]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "batch": self.batch, "tokens": self.tokens, "budget": self.budget,
            "device": self.device, "host": self.host, "format": self.format, "params": self.params,
            "compute_seconds": self.compute_seconds, "host_memory": self.host_memory,
            "results": {k: r.to_dict() for k, r in self.results.items()},
        }  # fmt: skip
