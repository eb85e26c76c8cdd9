"""``strategy="auto"`` inside the manager: profile the operators, choose keep / swap / recompute, apply the
choice to the model, and say what was done per module.

Note [Applying a joint plan]
1. The profiling iterations also run the operator profiler (swap.runtime.auto.op_profiler): the planner's operator
   table, and the candidate modules with the tensors a checkpoint of them would save.
2. After the last one, if the run fits the budget the manager declines as with any policy (no swap, no
   recompute). Otherwise the joint strategy (swap.joint.search, Note [Joint strategy]) picks a plan on the
   profiled sequence, the measured link and step times.
3. If the plan checkpoints modules or rebuilds activations, what the model saves changes: the manager wraps
   the modules' forward (swap.runtime.auto.regions, paths resolved in the root module the profiler saw), turns
   the rebuilds on, and profiles once more with the conservative plan, which keeps the budget whatever is
   saved. If the iteration that just began already entered a module it wraps, it profiles two (the first
   one is half wrapped). The swaps are then scheduled on that measured sequence with the plan's swap policy
   (the window when the plan swaps nothing: what the model misjudged, the window still fixes), never
   declined: the peak "without swapping" that declining relies on is measured from the tensors our hooks
   hold, and a checkpoint's frame holds the region inputs and kept outputs in its own way.
4. The wrappers come off when the manager exits, also after an exception.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ...joint.ops import OpTable, calibrated
from ...joint.regions import RecomputePlan
from ...joint.search import Evaluator, JointResult, checkpoint, checkpoint_window, search
from ...schedule.sequence import USE, Sequence
from ..activations.executor import Executor
from ..activations.hooks import SavedTensorHooks
from ..activations.tracer import Packed
from .op_profiler import OpProfiler, remove_mode
from .ranks import Ranks, agree
from .regions import Regions

log = logging.getLogger("swap")
DEFAULT_LINK = 10e9  # bytes/s: feasibility does not depend on it


@dataclass(frozen=True)
class JointDecision:
    """What the joint search chose, for the manager to apply (Note [Applying a joint plan], step 3): ``note``
    for the report; ``plan`` and ``modules`` (region path -> module), the recompute plan to apply, or None to
    swap only; ``profile_again``, the iterations to profile with it applied before scheduling."""

    note: str = ""
    plan: Optional[RecomputePlan] = None
    modules: dict[str, torch.nn.Module] = field(default_factory=dict)
    profile_again: int = 0


class JointRuntime:
    """The manager's side of ``strategy="auto"`` (Note [Applying a joint plan]) on ``device``, for ``budget``."""

    def __init__(self, device: torch.device, budget: int) -> None:
        self.device = device
        self.budget = budget
        self.profiler: Optional[OpProfiler] = None
        self.regions: Optional[Regions] = None
        self.result: Optional[JointResult] = None
        self.table: Optional[OpTable] = None
        self.decided = False
        self.why_none: Optional[str] = None  # why no plan was made, where the run needed one (for the report)
        # How the plan is chosen from the evaluator; a test or a benchmark may fix a strategy instead.
        self.choose: Callable[[Evaluator], JointResult] = search

    # -- lifecycle --------------------------------------------------------------------------------------
    def start(self, executor: Executor, hooks: SavedTensorHooks) -> None:
        """The manager entered: profile the operators ``executor`` runs through ``hooks``."""
        self.profiler = OpProfiler(executor, hooks, self.device)
        self.profiler.__enter__()
        self.regions = Regions(hooks, self.device)

    def close(self) -> None:
        """Unwraps the modules and lets go of them: a manager kept for its report must not keep the model."""
        try:
            if self.regions is not None:
                self.regions.remove()
        finally:
            self._stop_profiler()
            if self.profiler is not None:
                self.profiler.forget_modules()

    def _stop_profiler(self) -> None:
        p = self.profiler
        if p is not None and p.active:
            p.stop()
            remove_mode(p)

    # -- hooks (a SaveListener of swap.runtime.activations.hooks) ---------------------------------------------------
    def boundary(self) -> None:
        """An iteration is about to start (the manager's pack hook saw it)."""
        if self.profiler is not None and self.profiler.active:
            self.profiler.iteration_starts()

    def saved(self, t: torch.Tensor, packed: Any) -> None:
        if isinstance(packed, Packed) and self.profiler is not None and self.profiler.active:
            self.profiler.saved(t, packed.var.id)

    # -- planning ---------------------------------------------------------------------------------------
    def profiling_done(self) -> None:
        """The last profiling iteration was judged: the operator profiler is not needed any more."""
        if self.profiler is not None and self.table is None:
            self.table = self.profiler.table
        self._stop_profiler()

    def may_fit(self, seq: Sequence, budget: int) -> bool:
        """Whether checkpointing every block (swapping what is left) could fit ``budget`` where swapping alone
        cannot: judged on the first profiled iteration, to fail as early as the swap policies do."""
        table = self.profiler.table if self.profiler is not None else None
        if table is None or not table.calls:
            return False
        ev = Evaluator(seq, table, budget, DEFAULT_LINK, DEFAULT_LINK)
        return checkpoint_window(ev).feasible or checkpoint(ev).feasible

    def decide(self, seq: Sequence, h2d: float, d2h: float, ranks: Optional[Ranks] = None,
               declines: bool = False) -> JointDecision:  # fmt: skip
        """Chooses the plan (once), for the manager to apply: a plan that changes what the model saves comes
        with iterations to profile again; else the swaps are scheduled on ``seq`` with ``swap_policy``.

        With ``ranks``, the ranks of a process group choose together (Note [Ranks agree on a plan]): every rank
        calls this at its last profiling iteration, ``declines`` when it would not swap alone (it proposes
        nothing, and takes the agreed plan only if that plan recomputes)."""
        open_paths = self.profiler.open_paths if self.profiler is not None else set()
        self.profiling_done()
        self.decided = True
        table = self.table
        ev = None
        if table is not None and table.ops:
            if self.device.type == "cuda":
                first_use = next((i for i, k in enumerate(seq.kind) if k == USE), len(seq))
                table = self.table = calibrated(table, sum(seq.compute[:first_use]))
            ev = Evaluator(seq, table, self.budget, h2d, d2h)
        if ranks is None:
            if ev is None:
                return JointDecision("policy 'auto': no operator was profiled in the forward; swapping only")
            self.result = self.choose(ev)
        else:
            mine = self.choose(ev) if ev is not None and not declines else None
            proposal = mine.best.strategy if mine is not None and mine.best.feasible else None
            self.result = agree(ranks, ev, proposal)
            if self.result is None:
                why = "no rank proposed a plan" if declines or proposal is None else "no plan fits every rank"
                return JointDecision(f"policy 'auto' over {ranks.size} ranks: {why}; swapping only")
        result = self.result
        best = result.best
        if not best.feasible:
            return JointDecision(f"policy 'auto': no recompute plan fits the budget ({best.name}: {best.why}); "
                                 "swapping only")  # fmt: skip
        p = best.strategy.plan
        if not p.regions and not p.rebuild:
            return JointDecision()
        modules = {r.path: self.profiler.module(r.path) for r in p.regions}
        together = f" (agreed by {ranks.size} ranks)" if ranks is not None else ""
        note = (f"policy 'auto': {p.describe()}, swap policy {self.swap_policy!r} (simulated {best.step_time:.4g} s "
                f"per step; {result.evaluations} plans judged){together}; profiling again")  # fmt: skip
        return JointDecision(note, p, modules, 2 if open_paths & set(p.paths) else 1)

    @property
    def applied(self) -> bool:
        """Whether modules are checkpointed now."""
        return self.regions is not None and self.regions.applied

    @property
    def swap_policy(self) -> str:
        """The scheduler policy for what the plan still saves (Note [Applying a joint plan], step 3)."""
        if self.result is None or not self.result.best.feasible or self.result.best.strategy.swap == "none":
            return "window"
        return self.result.best.strategy.swap

    # -- report -----------------------------------------------------------------------------------------
    def snapshot(self, seq: Optional[Sequence], schedule: Any) -> dict[str, Any]:
        """The report's keys for ``strategy="auto"``: the plan, its simulated step, and the per-module rows."""
        best = self.result.best if self.result is not None else None
        swapped = {v for step in schedule.swap_out for v in step} if schedule is not None else set()
        rows = self.rows(seq, swapped) if seq is not None or best is not None else []
        if best is None:
            plan = f"none ({self.why_none or 'the run fits, or not planned yet'})"
        elif not best.feasible:
            plan = f"none ({best.name} does not fit the budget: swapping only)"
        else:
            plan = best.strategy.plan.describe()
        return {
            "recompute_plan": plan,
            "recompute_seconds": sum(r["recompute_seconds"] for r in rows),
            "simulated_step_seconds": best.step_time if best is not None and best.feasible else None,
            "modules": rows,
            **self.not_recomputable(),
        }

    def not_recomputable(self) -> dict[str, Any]:
        """What the profiled forward cannot recompute, and why (Note [Operators that cannot be rerun]):
        ``not_recomputable``, its operators grouped by (module, operator, reason) with their count per
        iteration (they are kept or swapped, never rerun), and ``not_checkpointed``, candidate module -> why
        it is never checkpointed (an in-place write to one of its inputs, a user's own checkpoint, ...)."""
        table = self.table if self.table is not None else (self.profiler.table if self.profiler is not None else None)
        if table is None:
            return {"not_recomputable": [], "not_checkpointed": {}}
        groups: dict[tuple[str, str, str], int] = {}
        for op in table.ops:
            if op.blocker:
                k = (op.module or "(outside modules)", op.name, op.blocker)
                groups[k] = groups.get(k, 0) + 1
        blocked: dict[str, str] = {}
        for c in table.calls:
            if c.blocker:
                blocked.setdefault(c.path, c.blocker)
        return {
            "not_recomputable": [{"module": m, "operator": n, "why": w, "count": k} for (m, n, w), k in groups.items()],
            "not_checkpointed": blocked,
        }

    def rows(self, seq: Optional[Sequence], swapped: set[int]) -> list[dict[str, Any]]:
        """Per module: bytes kept on the device, swapped and recomputed per iteration, and the recompute time
        over the run."""
        plan = self.result.best.strategy.plan if self.result is not None and self.result.best.feasible else None
        region_paths = plan.paths if plan is not None else []
        candidates = sorted(self.profiler.modules if self.profiler is not None else [], key=len)  # outermost first

        def group(module: str) -> str:  # the region it runs in, else the outermost candidate module
            for p in (*region_paths, *candidates):
                if module == p or module.startswith(p + "."):
                    return p
            return module or "(outside modules)"

        rows: dict[str, dict[str, Any]] = {}

        def row(name: str) -> dict[str, Any]:
            return rows.setdefault(name, {"module": name, "kept_bytes": 0, "swapped_bytes": 0, "recomputed_bytes": 0,
                                          "recompute_seconds": 0.0, "reruns": 0})  # fmt: skip

        if seq is not None:
            for v, size in enumerate(seq.sizes):
                r = row(group(seq.modules[v] if seq.modules else ""))
                r["swapped_bytes" if v in swapped else "kept_bytes"] += size
        if self.result is not None and self.result.best.model is not None and plan is not None:
            for path, b in self.result.best.model.recomputed_bytes.items():
                row(path)["recomputed_bytes"] += b
        if self.regions is not None:
            for path in region_paths:
                s = self.regions.stats_of(path)
                r = row(path)
                r["recompute_seconds"] = self.regions.rerun_seconds(path)
                r["reruns"] = s.reruns if s else 0
                if s and s.forced:
                    r["kept_because"] = dict(s.forced)
        return sorted(rows.values(), key=lambda r: r["module"])
