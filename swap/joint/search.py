"""Keep, swap or recompute: the baselines by name, and the joint strategy (``"auto"``) that is never slower.

Note [Joint strategy]
Every strategy is a recompute plan (regions and their kept operators, elementwise rebuilds: swap.joint.regions)
plus a swap policy for what the plan still saves (none, window, all, fixed_distance), and every one is judged
the same way: the sequence the runtime would record with that plan (``apply_regions``), scheduled under the
budget and replayed by the simulator on the link's bandwidths (VMM costs optional). Infeasible plans (the
budget cannot hold them) lose.

The joint strategy searches that space and keeps the fastest simulated step:
1. every baseline below is a candidate, so it is never slower than any of them on the same data;
2. at each level of candidate regions (Note [Candidate regions]), uniform plans: each block's keep set taken
   from a chain ordered like a knapsack (the operator whose rerun costs most per byte it keeps is kept first,
   so the cheap ones, norms, activations, dropout, are recomputed first) crossed with which blocks are
   checkpointed (all, every k-th, the first or last part), each with the window policy swapping what is left
   (region inputs and kept outputs included: "checkpoint a region and swap its inputs") and without swapping;
3. from the best, a local search per block: one step along its chain, or the block off or on, kept when
   the simulated step gets faster;
4. rebuilds (elementwise, batch norm) on or off (Note [Rebuilds in the search]).
Swapping is chosen where its copies hide behind compute (the window schedule and the simulator decide that);
recomputing where its seconds cost less than the stall it removes; both where the budget needs it.

Note [Rebuilds in the search]
Rebuilds change what the best regions are: a ResNet's batch norm rebuilds (Note [Batch norm rebuilds]) take a
sixth of every bottleneck off the link, so past the batch where whole blocks stop fitting, the best plan with
rebuilds is not the best plan without them with rebuilds switched on (ResNet-50 at 5x on the H100 profile:
498.4 samples/s without, 552.5 from the second refine below, `python -m bench.strategies`). Flipping rebuilds
on the refined best alone misses that, and doubling every uniform plan with
rebuilds halves the local search's share of the evaluations (worse plans at 2x and 7x when tried). So the
search refines twice: from the best plan without rebuilds, as before, then from the better of "window with
rebuilds" and that plan with rebuilds, with a quarter of the evaluations more. Models without rebuild
candidates pay nothing.

Note [No collection during the search]
The search plans and simulates a few thousand schedules, each a few lists per step, and keeps every judged
plan's schedule and simulation: Python's cyclic collector, counting those allocations, ran full collections
over the whole heap (the model and torch included, at runtime) again and again, about a third of the search's
time on a 6-layer Llama profile (2.7 of 7.5 s). Nothing the search makes needs the collector (its objects
form no cycles; reference counting frees them), so ``search`` pauses it, and turns it back on, if it was on,
when it returns or raises. The result is the same: collection frees garbage, it decides nothing.
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from ..schedule.budget import InfeasibleBudget
from ..schedule.scheduler import POLICIES, Schedule
from ..schedule.sequence import Sequence
from ..schedule.simulator import SimResult, schedule_for
from .ops import OpTable, is_selective
from .regions import RecomputePlan, Region, RegionModel, apply_regions, rebuild_recipes

log = logging.getLogger("swap")

Vmm = Callable[[Sequence, Schedule], list[float]]


@dataclass(frozen=True)
class Strategy:
    """A recompute plan and the swap policy for what it still saves."""

    name: str
    plan: RecomputePlan = RecomputePlan()
    swap: str = "none"
    detail: str = ""  # e.g. the level and k of every-k-th checkpointing


@dataclass
class Outcome:
    """A strategy judged on one sequence, budget and link (Note [Joint strategy])."""

    strategy: Strategy
    feasible: bool
    step_time: float  # simulated seconds per iteration; inf when infeasible
    why: str = ""  # why it is infeasible
    sequence: Optional[Sequence] = None
    schedule: Optional[Schedule] = None
    sim: Optional[SimResult] = None
    model: Optional[RegionModel] = None
    window: Optional[int] = None

    @property
    def name(self) -> str:
        return self.strategy.name

    @property
    def peak(self) -> Optional[int]:
        return self.schedule.peak if self.schedule is not None else None

    @property
    def recompute_seconds(self) -> float:
        return self.model.recompute_seconds if self.model is not None else 0.0

    @property
    def recomputed_bytes(self) -> int:
        return sum(self.model.recomputed_bytes.values()) if self.model is not None else 0

    @property
    def copied_bytes(self) -> int:
        return self.sim.d2h_bytes + self.sim.h2d_bytes if self.sim is not None else 0

    def rank(self) -> tuple[float, float, int, int]:
        """Faster first; at equal time, less recompute, fewer bytes copied, fewer regions."""
        return (self.step_time, self.recompute_seconds, self.copied_bytes, len(self.strategy.plan.regions))


class Evaluator:
    """Judges strategies on one profile (Note [Joint strategy]); results are cached by strategy."""

    def __init__(self, seq: Sequence, table: OpTable, budget: int, h2d_bandwidth: float, d2h_bandwidth: float,
                 vmm: Optional[Vmm] = None) -> None:  # fmt: skip
        if budget <= 0:
            raise ValueError(f"the budget must be positive, not {budget}")
        self.seq, self.table, self.budget = seq, table, budget
        self.h2d, self.d2h, self.vmm = h2d_bandwidth, d2h_bandwidth, vmm
        self._models: dict[RecomputePlan, RegionModel] = {}
        self._outcomes: dict[tuple[RecomputePlan, str], Outcome] = {}
        self.evaluations = 0

    def model(self, p: RecomputePlan) -> RegionModel:
        m = self._models.get(p)
        if m is None:
            m = self._models[p] = apply_regions(self.seq, self.table, p)
        return m

    def evaluate(self, s: Strategy) -> Outcome:
        key = (s.plan, s.swap)
        cached = self._outcomes.get(key)
        if cached is not None:
            return replace(cached, strategy=s)
        if s.swap not in POLICIES:
            raise ValueError(f"unknown swap policy {s.swap!r}: choose one of {', '.join(POLICIES)}")
        self.evaluations += 1
        m = self.model(s.plan)
        seq = m.sequence
        try:
            vmm = (lambda sched: self.vmm(seq, sched)) if self.vmm else None
            window, sched, sim = schedule_for(seq, self.budget, s.swap, self.h2d, self.d2h, vmm=vmm)
            out = Outcome(s, True, sim.step_time, "", seq, sched, sim, m, window)
        except InfeasibleBudget as e:
            out = Outcome(s, False, math.inf, str(e).split("\n")[0], seq, None, None, m)
        self._outcomes[key] = out
        return out


# -- plans by level -------------------------------------------------------------------------------------------
def _saved_in(ev: Evaluator, path: str) -> set[int]:
    seq = ev.seq
    out: set[int] = set()
    for c in ev.table.calls_of(path):
        out |= {seq.var[i] for i in range(*c.steps) if seq.kind[i] == "save"}
    return out


def _candidates(ev: Evaluator, path: str) -> list[tuple[float, int, tuple[str, int]]]:
    """The operators of ``path``'s first call whose outputs may be kept (``OpTable.keep_candidates``), in
    operator order: (seconds, bytes it keeps, key)."""
    calls = ev.table.calls_of(path)
    if not calls:
        return []
    c = calls[0]
    keys = ev.table.op_keys(c)
    out = []
    for j in ev.table.keep_candidates(c, _saved_in(ev, path)):
        op = ev.table.ops[j]
        out.append((op.seconds, sum(ev.seq.sizes[v] for v in op.outputs if v >= 0), keys[j - c.ops[0]]))
    return out


def keep_chain(ev: Evaluator, path: str) -> list[frozenset]:
    """The keep sets of ``path``, from none (full checkpointing) to every candidate, adding first the operator
    whose rerun costs most per byte it keeps (Note [Joint strategy]); ties in operator order."""
    scored = sorted(_candidates(ev, path), key=lambda x: -x[0] / (x[1] or 1))
    chain, cur = [frozenset()], set()
    for _, _, key in scored:
        cur.add(key)
        chain.append(frozenset(cur))
    return chain


def selective_keep(ev: Evaluator, path: str) -> frozenset:
    """Selective checkpointing's keep set: matmul, convolution and attention outputs."""
    return frozenset(key for _, _, key in _candidates(ev, path) if is_selective(key[0]))


def _plan(paths: list[str], keep: Optional[Callable[[str], frozenset]] = None, rebuild: bool = False) -> RecomputePlan:
    return RecomputePlan(tuple(Region(p, keep(p) if keep else frozenset()) for p in paths), rebuild)


def _order(o: Outcome) -> tuple[bool, tuple[float, float, int, int]]:
    """Feasible outcomes first, then by rank (fastest first)."""
    return not o.feasible, o.rank()


def _best(outcomes: list[Outcome], name: str) -> Outcome:
    """The fastest feasible outcome, renamed ``name``; the first one if none is feasible."""
    ok = [o for o in outcomes if o.feasible]
    pick = min(ok, key=Outcome.rank) if ok else outcomes[0]
    s = pick.strategy
    return replace(pick, strategy=Strategy(name, s.plan, s.swap, s.detail or s.name))


def _levels(ev: Evaluator) -> dict[str, list[str]]:
    return ev.table.level_sets()


def _no_regions(ev: Evaluator, name: str, swap: str) -> Outcome:
    return ev.evaluate(Strategy(name, RecomputePlan(), swap))


def _per_level(ev: Evaluator, name: str, swap: str, keep: Optional[Callable[[Evaluator, str], frozenset]] = None,
               every: int = 1) -> Outcome:  # fmt: skip
    outs = []
    for level, paths in _levels(ev).items():
        chosen = paths[::every]
        p = _plan(chosen, (lambda q: keep(ev, q)) if keep else None)
        outs.append(ev.evaluate(Strategy(name, p, swap, f"{level}" + (f", every {every}" if every > 1 else ""))))
    if not outs:
        return Outcome(Strategy(name), False, math.inf, "no candidate regions (no repeated blocks in containers)")
    return _best(outs, name)


# -- the baselines --------------------------------------------------------------------------------------------
def none(ev: Evaluator) -> Outcome:
    """Nothing swapped, nothing recomputed."""
    return _no_regions(ev, "none", "none")


def checkpoint(ev: Evaluator) -> Outcome:
    """Full checkpointing of every block (HF's ``gradient_checkpointing_enable``), no swapping."""
    return _per_level(ev, "checkpoint", "none")


def checkpoint_every_k(ev: Evaluator) -> Outcome:
    """Full checkpointing of every k-th block, with the best k, no swapping."""
    longest = max((len(paths) for paths in _levels(ev).values()), default=0)
    outs = [_per_level(ev, "checkpoint_every_k", "none", every=k) for k in range(2, longest + 1)]  # every level each
    return _best(outs, "checkpoint_every_k") if outs else checkpoint(ev)


def selective(ev: Evaluator) -> Outcome:
    """Selective checkpointing: keep matmul, convolution and attention outputs, recompute the rest; no swapping."""
    return _per_level(ev, "selective", "none", selective_keep)


def knapsack(ev: Evaluator) -> Outcome:
    """torch.compile's memory budget: from every block checkpointed with every candidate kept, recompute the
    operators with the most bytes per recompute second first, until the no-swap peak fits the budget. Where the
    step fits without recomputing, nothing is recomputed (as compile's budget of 1.0)."""
    plain = _no_regions(ev, "knapsack", "none")
    if plain.feasible:
        return plain
    outs = []
    for paths in _levels(ev).values():
        items = []  # (bytes per second, path, key), in operator order: ties keep it (the sort is stable)
        for p in paths:
            items += [(nbytes / max(secs, 1e-12), p, key) for secs, nbytes, key in _candidates(ev, p)]
        items.sort(key=lambda x: -x[0])

        def plan_dropping(k: int, paths: list[str] = paths, items: list = items) -> RecomputePlan:
            kept = {p: [] for p in paths}
            for _, p, key in items[k:]:
                kept[p].append(key)
            return _plan(paths, lambda q: frozenset(kept[q]))

        lo, hi = 0, len(items)  # the fewest drops that fit (more drops, less memory)
        everything = ev.evaluate(Strategy("knapsack", plan_dropping(hi), "none"))
        if not everything.feasible:
            outs.append(everything)
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            if ev.evaluate(Strategy("knapsack", plan_dropping(mid), "none")).feasible:
                hi = mid
            else:
                lo = mid + 1
        outs.append(ev.evaluate(Strategy("knapsack", plan_dropping(lo), "none", f"{lo} of {len(items)} recomputed")))
    if not outs:
        return Outcome(Strategy("knapsack"), False, math.inf, "no candidate regions (no repeated blocks in containers)")
    return _best(outs, "knapsack")


def window(ev: Evaluator) -> Outcome:
    """Swap only, by the window policy; nothing recomputed."""
    return _no_regions(ev, "window", "window")


def fixed_distance(ev: Evaluator) -> Outcome:
    """TFLMS's swap rule, nothing recomputed."""
    return _no_regions(ev, "fixed_distance", "fixed_distance")


def swap_all(ev: Evaluator) -> Outcome:
    """``save_on_cpu``: every saved tensor to the host and back (vDNN, ``policy="all"``)."""
    return _no_regions(ev, "all", "all")


def checkpoint_offload(ev: Evaluator) -> Outcome:
    """Full checkpointing with the checkpointed inputs offloaded (torchtune, accelerate: save_on_cpu outside
    the checkpoint)."""
    return _per_level(ev, "checkpoint_offload", "all")


def checkpoint_window(ev: Evaluator) -> Outcome:
    """Full checkpointing, what it still saves swapped by the window policy."""
    return _per_level(ev, "checkpoint_window", "window")


BASELINES: dict[str, Callable[[Evaluator], Outcome]] = {
    "none": none,
    "checkpoint": checkpoint,
    "checkpoint_every_k": checkpoint_every_k,
    "selective": selective,
    "knapsack": knapsack,
    "all": swap_all,
    "checkpoint_offload": checkpoint_offload,
    "checkpoint_window": checkpoint_window,
    "window": window,
    "fixed_distance": fixed_distance,
}
STRATEGIES = (*BASELINES, "auto")  # every strategy by name (Note [Policy and strategy] in swap/__init__.py)


# -- the joint strategy -----------------------------------------------------------------------------------------
@dataclass
class JointResult:
    best: Outcome
    baselines: dict[str, Outcome] = field(default_factory=dict)
    evaluations: int = 0


def auto(ev: Evaluator, max_evaluations: int = 400) -> Outcome:
    """The joint strategy (Note [Joint strategy]): the fastest feasible strategy found, never slower than a
    baseline."""
    return search(ev, max_evaluations).best


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (Note [No collection during the search])."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def search(ev: Evaluator, max_evaluations: int = 400) -> JointResult:
    """``auto`` with the baselines it compared (Note [Joint strategy]); the garbage collector is paused while it
    runs (Note [No collection during the search])."""
    with _collector_paused():
        return _search(ev, max_evaluations)


def _search(ev: Evaluator, max_evaluations: int) -> JointResult:
    baselines = {name: fn(ev) for name, fn in BASELINES.items()}
    pool = list(baselines.values())
    for level, paths in _levels(ev).items():
        chains = {p: keep_chain(ev, p) for p in paths}
        depth = max((len(c) for c in chains.values()), default=0)
        variants: list[Callable[[str], frozenset]] = [lambda p, m=m, ch=chains: ch[p][min(m, len(ch[p]) - 1)]
                                                      for m in range(depth)]  # fmt: skip
        variants.append(lambda p: selective_keep(ev, p))
        n = len(paths)
        subsets = {tuple(paths[::k]) for k in (1, 2, 3, 4)}
        subsets |= {tuple(paths[: max(1, n * q // 4)]) for q in (1, 2, 3)}
        subsets |= {tuple(paths[n - max(1, n * q // 4):]) for q in (1, 2, 3)}
        for keep in variants:
            for chosen in sorted(subsets):
                for swap in ("window", "none"):
                    if ev.evaluations >= max_evaluations:
                        break
                    pool.append(ev.evaluate(Strategy("auto", _plan(list(chosen), keep), swap, level)))
    best = min(pool, key=_order)
    if best.feasible:
        best = _refine(ev, best, max_evaluations)
        if rebuild_recipes(ev.seq, ev.table)[0]:  # Note [Rebuilds in the search]
            starts = [ev.evaluate(Strategy("auto", RecomputePlan((), True), "window")),
                      ev.evaluate(Strategy("auto", RecomputePlan(best.strategy.plan.regions, True), best.strategy.swap,
                                           best.strategy.detail))]  # fmt: skip
            start = min(starts, key=_order)
            if start.feasible:
                trial = _refine(ev, start, ev.evaluations + max_evaluations // 4)
                best = trial if trial.rank() < best.rank() else best
        flipped = RecomputePlan(best.strategy.plan.regions, not best.strategy.plan.rebuild)
        trial = ev.evaluate(Strategy("auto", flipped, best.strategy.swap, best.strategy.detail))
        if trial.feasible and trial.rank() < best.rank():
            best = trial
    s = best.strategy
    best = replace(best, strategy=Strategy("auto", s.plan, s.swap, s.detail if s.name == "auto" else s.name))
    log.info("swap: joint strategy: %s with swap %r, simulated %.4f s per step (%d plans judged)",
             s.plan.describe(), s.swap, best.step_time, ev.evaluations)  # fmt: skip
    return JointResult(best, baselines, ev.evaluations)


def _refine(ev: Evaluator, best: Outcome, max_evaluations: int) -> Outcome:
    """Local search per block (Note [Joint strategy], step 3)."""
    level = next((lv for lv, paths in _levels(ev).items()
                  if set(best.strategy.plan.paths) <= set(paths)), None)  # fmt: skip
    if level is None:
        return best
    paths = _levels(ev)[level]
    chains = {p: keep_chain(ev, p) for p in paths}
    swap, rebuild = best.strategy.swap, best.strategy.plan.rebuild
    state: dict[str, Optional[int]] = {p: None for p in paths}  # None: not checkpointed; else chain index
    for r in best.strategy.plan.regions:
        chain = chains[r.path]
        state[r.path] = chain.index(r.keep) if r.keep in chain else None
        if state[r.path] is None:  # a keep set off the chain (selective): start from the nearest size
            state[r.path] = min(range(len(chain)), key=lambda m: abs(len(chain[m]) - len(r.keep)))

    def plan_of(st: dict[str, Optional[int]]) -> RecomputePlan:
        return RecomputePlan(tuple(Region(p, chains[p][m]) for p, m in st.items() if m is not None), rebuild)

    current = ev.evaluate(Strategy("auto", plan_of(state), swap, level))
    if not current.feasible or current.rank() > best.rank():
        current = best
        if any(r.keep not in chains[r.path] for r in best.strategy.plan.regions):
            return best
    improved = True
    while improved and ev.evaluations < max_evaluations:
        improved = False
        for p in paths:
            m = state[p]
            moves = [None, 0] if m is None else [m - 1, m + 1, None]
            for nm in moves:
                if nm is not None and not 0 <= nm < len(chains[p]):
                    continue
                if ev.evaluations >= max_evaluations:
                    break
                trial_state = {**state, p: nm}
                trial = ev.evaluate(Strategy("auto", plan_of(trial_state), swap, level))
                if trial.feasible and trial.rank() < current.rank():
                    state, current, improved = trial_state, trial, True
                    break
    return current if current.rank() < best.rank() else best
