"""SwapReport: the manager's counters as a dict that prints as a table."""

from __future__ import annotations

from typing import Any


def _bytes(n: Any) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


class SwapReport(dict):
    """``sm.report()``: keys include iterations, swapped_out_bytes, swapped_in_bytes, demand_fetches,
    stall_seconds, peak_device_bytes, budget_bytes, window_bytes, replans, policy."""

    ROWS = [
        ("policy", "policy", str),
        ("iterations", "iterations", str),
        ("budget_bytes", "budget", _bytes),
        ("peak_device_bytes", "peak device memory", _bytes),
        ("planned_peak_bytes", "planned peak", _bytes),
        ("no_swap_peak_bytes", "peak without swapping", _bytes),
        ("window_bytes", "window", _bytes),
        ("swapped_out_bytes", "swapped out", _bytes),
        ("swapped_in_bytes", "swapped in", _bytes),
        ("demand_fetches", "demand fetches", str),
        ("stall_seconds", "stall", lambda s: f"{s:.3f} s"),
        ("replans", "re-plans", str),
        ("evictions", "OOM evictions", str),
        ("host_pool_bytes", "host pool", _bytes),
        ("declined", "declined to swap", str),
    ]

    def __str__(self) -> str:
        lines = ["swap report", "-" * 44]
        for key, label, fmt in self.ROWS:
            if key in self:
                lines.append(f"{label:<24}{fmt(self[key]) if self[key] is not None else '-':>20}")
        for note in self.get("notes", []):
            lines.append(f"note: {note}")
        return "\n".join(lines)
