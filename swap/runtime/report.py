"""SwapReport: the manager's counters as a dict that prints as a table."""

from __future__ import annotations

from ..units import fmt_size as _bytes


class SwapReport(dict):
    """``sm.report()``: keys include status ("not started", "profiling", "planned", "declined", ...),
    iterations, swapped_out_bytes, swapped_in_bytes, demand_fetches, stall_seconds, peak_device_bytes,
    entry_peak_bytes (the peak from the manager's entry to its first iteration, part of peak_device_bytes: Note
    [The memory before the first iteration] in swap.runtime.activations.executor; None before that iteration),
    budget_bytes, window_bytes, profiling_iterations, replans (plans remade or fallen back from; profiling
    iterations apart), plan_events (``(iteration, "profile" | "replan" | "refine")`` from iteration 0: where
    that work fell), shapes_seen, plans_kept, plans_reused, plans_derived and plans_refined (Note [Plans by
    input shape] in swap.runtime.activations.plan_book), overruns (windows of measured memory above the budget,
    above zero exactly when peak_device_bytes is: Note [What the over-budget count counts] in
    swap.runtime.machine.memory),
    min_budget_bytes, policy, memory_source and peak_measured_inside_ops (False on CPU: the peak is of live tensor bytes
    between operators, see swap.runtime.machine.meter), and notes. With ``strategy="auto"`` also recompute_plan,
    recompute_seconds, simulated_step_seconds, ``modules``: per module, bytes kept on the device, swapped
    and recomputed per iteration, and the seconds spent recomputing it, ``not_recomputable``: the operators
    that cannot be recomputed (module, operator, why, count per iteration) and ``not_checkpointed``: candidate
    modules that are never checkpointed, and why (swap.runtime.auto.joint). With rebuilds on (``recompute=True``, or
    chosen by "auto"): ``rebuilds`` run over the whole run (one per backward use of a rebuilt tensor) and
    ``rebuilt_bytes``, what they made on the device instead of moving it (Note [Recompute or swap]). With model
    state managed (``model=``, ``optimizer=``): ``model_state``, a dict of its placements and buckets, bytes moved
    per kind (weights in/out, gradients out, activations in/out), host optimizer seconds and the part something
    waited for, host and pinned bytes against their prediction, and ``steps``: the same per optimizer step."""

    ROWS = [
        ("status", "status", str),
        ("policy", "policy", str),
        ("iterations", "iterations", str),
        ("budget_bytes", "budget", _bytes),
        ("peak_device_bytes", "peak device memory", _bytes),
        ("entry_peak_bytes", "peak before iteration 1", _bytes),
        ("planned_peak_bytes", "planned peak", _bytes),
        ("no_swap_peak_bytes", "peak without swapping", _bytes),
        ("min_budget_bytes", "smallest budget", _bytes),
        ("window_bytes", "window", _bytes),
        ("swapped_out_bytes", "swapped out", _bytes),
        ("swapped_in_bytes", "swapped in", _bytes),
        ("demand_fetches", "demand fetches", str),
        ("stall_seconds", "stall", lambda s: f"{s:.3f} s"),
        ("profiling_iterations", "profiling iterations", str),
        ("replans", "re-plans", str),
        ("shapes_seen", "input shapes seen", str),
        ("plans_reused", "kept plans reused", str),
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
        ms = self.get("model_state")
        if ms:
            lines.extend(_model_state_lines(ms))
        for note in self.get("notes", []):
            lines.append(f"note: {note}")
        return "\n".join(lines)


def _model_state_lines(ms: dict) -> list[str]:
    """The model-state part of the table: totals, then one row per optimizer step."""
    lines = ["", "model state"]
    if "placements" in ms:
        lines.append(f"{'placements':<30}{', '.join(f'{n} {p}' for p, n in ms['placements'].items()):>18}")
    for key, label in (("host_bytes", "host"), ("pinned_bytes", "pinned")):
        if key in ms:
            figure = f"{_bytes(ms[key])} ({_bytes(ms[key + '_predicted'])})"
            lines.append(f"{label + ' (predicted)':<30}{figure:>18}")
    if "host_step_seconds" in ms:
        figure = f"{ms['host_step_seconds']:.3f} s ({ms['host_step_exposed_seconds']:.3f} s)"
        lines.append(f"{'host optimizer (waited for)':<30}{figure:>18}")
    steps = ms.get("steps", [])
    if steps:
        lines.append("")
        lines.append(f"{'step':>5}{'weights in':>12}{'out':>9}{'grads out':>11}{'act. in':>10}{'act. out':>10}"
                     f"{'host opt':>10}{'hidden':>9}{'stalls':>9}")  # fmt: skip
        for r in steps:
            lines.append(
                f"{r['step']:>5}{_bytes(r['weights_in_bytes']):>12}{_bytes(r['weights_out_bytes']):>9}"
                f"{_bytes(r['grads_out_bytes']):>11}{_bytes(r['activations_in_bytes']):>10}"
                f"{_bytes(r['activations_out_bytes']):>10}{r['host_step_seconds']:>9.3f}s"
                f"{r['host_step_hidden_seconds']:>8.3f}s{r['exposed_stall_seconds']:>8.3f}s"
            )
        lines.append("(per optimizer step: the passes before it and its host update; stalls: waits for weights "
                     "and for the update)")  # fmt: skip
    return lines
