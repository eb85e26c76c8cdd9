"""SwapReport: the manager's counters as a dict that prints as a table."""

from __future__ import annotations

from ..units import fmt_size as _bytes


class SwapReport(dict):
    """``sm.report()``: keys include status ("not started", "profiling", "planned", "declined", ...),
    iterations, swapped_out_bytes, swapped_in_bytes, demand_fetches, stall_seconds, peak_device_bytes,
    budget_bytes, window_bytes, replans, overruns (steps measured above the budget), min_budget_bytes,
    policy, memory_source and peak_measured_inside_ops (False on CPU: the peak is of live tensor bytes
    between operators, see swap.runtime.meter), and notes. With ``strategy="auto"`` also recompute_plan,
    recompute_seconds, simulated_step_seconds, ``modules``: per module, bytes kept on the device, swapped
    and recomputed per iteration, and the seconds spent recomputing it, ``not_recomputable``: the operators
    that cannot be recomputed (module, operator, why, count per iteration) and ``not_checkpointed``: candidate
    modules that are never checkpointed, and why (swap.runtime.joint). With rebuilds on (``recompute=True``, or
    chosen by "auto"): ``rebuilds`` run over the whole run (one per backward use of a rebuilt tensor) and
    ``rebuilt_bytes``, what they made on the device instead of moving it (Note [Recompute or swap])."""

    ROWS = [
        ("status", "status", str),
        ("policy", "policy", str),
        ("iterations", "iterations", str),
        ("budget_bytes", "budget", _bytes),
        ("peak_device_bytes", "peak device memory", _bytes),
        ("planned_peak_bytes", "planned peak", _bytes),
        ("no_swap_peak_bytes", "peak without swapping", _bytes),
        ("min_budget_bytes", "smallest budget", _bytes),
        ("window_bytes", "window", _bytes),
        ("swapped_out_bytes", "swapped out", _bytes),
        ("swapped_in_bytes", "swapped in", _bytes),
        ("demand_fetches", "demand fetches", str),
        ("stall_seconds", "stall", lambda s: f"{s:.3f} s"),
        ("replans", "re-plans", str),
        ("overruns", "steps over budget", str),
        ("evictions", "OOM evictions", str),
        ("host_pool_bytes", "host pool", _bytes),
        ("declined", "declined to swap", str),
        ("recompute_plan", "recompute", str),
        ("recompute_seconds", "recompute time", lambda s: f"{s:.3f} s"),
        ("rebuilds", "rebuilds run", str),
        ("rebuilt_bytes", "rebuilt, not moved", _bytes),
    ]

    def __str__(self) -> str:
        lines = ["swap report", "-" * 48]
        for key, label, fmt in self.ROWS:
            if key not in self:
                continue
            if key == "peak_device_bytes" and self.get("peak_measured_inside_ops") is False:
                label = "peak (between-op live bytes)"
            lines.append(f"{label:<30}{fmt(self[key]) if self[key] is not None else '-':>18}")
        rows = [r for r in self.get("modules", []) if r["kept_bytes"] or r["swapped_bytes"] or r["recomputed_bytes"]]
        if rows:
            lines.append("")
            lines.append(f"{'module':<34}{'kept':>11}{'swapped':>11}{'recomputed':>11}{'rerun':>10}")
            for r in rows:
                lines.append(f"{r['module'][:33]:<34}{_bytes(r['kept_bytes']):>11}{_bytes(r['swapped_bytes']):>11}"
                             f"{_bytes(r['recomputed_bytes']):>11}{r['recompute_seconds']:>9.3f}s")  # fmt: skip
            lines.append("(bytes per iteration; rerun: seconds recomputing over the run)")
        ops = self.get("not_recomputable", [])
        if ops:
            lines.append("")
            lines.append("cannot be recomputed (kept or swapped instead):")
            for r in ops:
                lines.append(f"  {r['module']}: {r['operator']} x{r['count']}: {r['why']}")
        blocked = self.get("not_checkpointed", {})
        if blocked:
            lines.append("")
            lines.append("modules never checkpointed:")
            lines.extend(f"  {path}: {why}" for path, why in blocked.items())
        for note in self.get("notes", []):
            lines.append(f"note: {note}")
        return "\n".join(lines)
