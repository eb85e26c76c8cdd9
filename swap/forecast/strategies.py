"""Every strategy side by side: each baseline of ``swap.joint.search`` and the joint strategy (``"auto"``),
from the same capture on the same device profile, with its largest batch and its speed.

Note [Strategies from one capture]
Per batch, the captured trace gives the Sequence (``sequence_from_trace``) and the operator table
(``table_from_trace``), both priced on the device's roofline from the same operator events, so a rerun costs
what the forward's operators cost (Note [Per-operator roofline]). One ``joint.Evaluator`` per batch judges
every strategy on them (Note [Joint strategy]), its outcomes cached, so the baselines and the joint strategy share
their simulations. Per strategy:

- its largest batch: the planner's search (gallop, then bisect) on whether the strategy is feasible; for the
  joint strategy, the largest of the baselines' (its search starts from every baseline, so it fits wherever
  one does), then one sample more is tried, and where a mixed plan fits there the search goes on upward;
- its speed at chosen batches (the requested one, multiples of the no-swap batch, every strategy's largest)
  wherever it fits. Where nothing needs saving the joint strategy is "none": nothing is faster than not
  swapping and not recomputing;
- what stops it one sample past its largest batch (the scheduler's reason, e.g. the step whose working set
  alone exceeds the budget: at a 50k vocabulary, the LM head's logits and the loss).

Plans are judged on the ideal allocator (no fragmentation): the swap policies' own rows (``Plan.policies``)
replay the allocator; the strategies compare plans, not allocators.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from ..capture import Trace, live_peak
from ..devices import DeviceProfile
from ..joint.search import BASELINES, STRATEGIES, Evaluator, Outcome, Strategy, search
from ..schedule.sequence import Sequence
from .ops_from_trace import table_from_trace
from .pricing import event_seconds, iteration_seconds

MULTIPLES = (1, 2, 3, 5, 10)  # of the no-swap batch: where the strategies are compared
AUTO_EVALUATIONS = 200  # plans the joint strategy judges per batch (Note [Joint strategy])


def check_strategies(names: tuple[str, ...]) -> None:
    """ValueError naming the first of ``names`` that is not a strategy, and the ones there are."""
    for name in names:
        if name not in STRATEGIES:
            raise ValueError(f"unknown strategy {name!r}: choose among {', '.join(STRATEGIES)}")


@dataclass
class Point:
    """One strategy at one batch."""

    batch: int
    fits: bool
    samples_per_s: Optional[float] = None
    step_time: Optional[float] = None  # simulated seconds per step
    stall_time: Optional[float] = None  # of which the compute stream waits for copies
    peak: Optional[int] = None  # planned device bytes at the peak
    recompute_seconds: float = 0.0  # per step
    recomputed_bytes: int = 0  # saved bytes rebuilt in the backward instead of kept
    copied_bytes: int = 0  # bytes over the host link per step, both ways
    plan: str = ""  # what the strategy chose here: regions, kept operators, swap policy
    why: str = ""  # why it does not fit

    @classmethod
    def of(cls, o: Outcome, batch: int) -> Point:
        """The point of outcome ``o`` at ``batch``: its speed and costs where it fits, why not where not."""
        s = o.strategy
        what = f"{s.plan.describe()}, swap {s.swap}" + (f" ({s.detail})" if s.detail else "")
        if not o.feasible:
            return cls(batch, False, plan=what, why=o.why)
        speed = batch / o.step_time if o.step_time > 0 else None
        return cls(batch, True, speed, o.step_time, o.sim.stall_time if o.sim else 0.0, o.peak, o.recompute_seconds,
                   o.recomputed_bytes, o.copied_bytes, what)  # fmt: skip


@dataclass
class StrategyResult:
    """One strategy: its largest batch, and its speed at the batches compared."""

    name: str
    max_batch: int  # 0: not even one sample fits
    points: dict[int, Point] = field(default_factory=dict)  # batch -> the strategy there
    blocker: str = ""  # what stops it one sample past max_batch
    trials: int = 0  # batch sizes evaluated by the search

    @property
    def at_max(self) -> Optional[Point]:
        return self.points.get(self.max_batch)

    def at(self, batch: int) -> Optional[Point]:
        return self.points.get(batch)


class StrategyBook:
    """Judges strategies per batch (Note [Strategies from one capture]); evaluators cached per batch."""

    def __init__(self, trace_at: Callable[[int], Trace], sequence_at: Callable[[int], Sequence], dev: DeviceProfile,
                 budget: int, min_bytes: int, auto_evaluations: int = AUTO_EVALUATIONS) -> None:  # fmt: skip
        self.trace_at, self.sequence_at, self.dev = trace_at, sequence_at, dev
        self.budget, self.min_bytes, self.auto_evaluations = budget, min_bytes, auto_evaluations
        self._evaluators: dict[int, Evaluator] = {}
        self._outcomes: dict[tuple[str, int], Outcome] = {}

    def evaluator(self, n: int) -> Evaluator:
        """The joint strategy's evaluator at batch ``n``: the Sequence and operator table of the trace at ``n``,
        under this book's budget and device (built once per batch, until ``forget``)."""
        ev = self._evaluators.get(n)
        if ev is None:
            trace = self.trace_at(n)
            table = table_from_trace(trace, min_bytes=self.min_bytes, seconds=event_seconds(trace, self.dev))
            ev = self._evaluators[n] = Evaluator(self.sequence_at(n), table, self.budget, self.dev.h2d_bandwidth,
                                                 self.dev.d2h_bandwidth)  # fmt: skip
        return ev

    def outcome(self, name: str, n: int) -> Outcome:
        """Strategy ``name`` at batch ``n``."""
        key = (name, n)
        if key not in self._outcomes:
            check_strategies((name,))
            ev = self.evaluator(n)
            if len(ev.seq) == 0:  # nothing is saved: every strategy runs the step as it is
                trace = self.trace_at(n)
                self._outcomes[key] = Outcome(Strategy(name, detail="nothing saved"), live_peak(trace) <= self.budget,
                                              iteration_seconds(trace, self.dev), "the step alone exceeds the budget",
                                              sequence=ev.seq)  # fmt: skip
            elif name == "auto":
                self._outcomes[key] = self._auto(n)
            else:
                self._outcomes[key] = BASELINES[name](ev)
        return self._outcomes[key]

    def _auto(self, n: int) -> Outcome:
        plain = self.outcome("none", n)
        if plain.feasible:  # nothing is faster than neither swapping nor recomputing
            return replace(plain, strategy=replace(plain.strategy, name="auto"))
        return search(self.evaluator(n), self.auto_evaluations).best

    def fits(self, name: str, n: int) -> bool:
        """Whether strategy ``name`` keeps batch ``n`` within the budget."""
        return self.outcome(name, n).feasible

    def forget(self, keep: set[int]) -> None:
        """Drops the evaluators of other batches (their sequences and simulations hold memory)."""
        self._evaluators = {n: ev for n, ev in self._evaluators.items() if n in keep}
        self._outcomes = {k: o for k, o in self._outcomes.items() if k[1] in keep}


Search = Callable[[Callable[[int], bool], int], tuple[int, int]]  # (fits, guess) -> (largest batch, trials)


def compare(book: StrategyBook, names: tuple[str, ...], largest: Search, guess: int, batch: Optional[int] = None,
            say: Callable[[str], None] = lambda _m: None) -> dict[str, StrategyResult]:  # fmt: skip
    """Every strategy in ``names``: its largest batch (``largest(fits, guess) -> (batch, trials)``, searched
    from ``guess``) and its speed at ``batch`` (the one asked for), at ``MULTIPLES`` of the largest batch
    without swapping or recomputing ("none"'s, judged whether or not it is in ``names``) and at every
    strategy's largest batch (Note [Strategies from one capture])."""
    check_strategies(names)
    results: dict[str, StrategyResult] = {}
    guess = max(1, guess)
    for name in ["none", *(n for n in names if n not in ("auto", "none"))]:
        t0 = time.perf_counter()
        n, trials = largest(lambda k, name=name: book.fits(name, k), guess)
        results[name] = StrategyResult(name, n, trials=trials)
        say(f"strategy {name}: largest batch {n} ({trials} batch sizes tried, {time.perf_counter() - t0:.1f} s)")
    if "auto" in names:
        if set(BASELINES) <= set(results):  # it fits wherever a baseline does (Note [Strategies from one capture])
            floor = max(r.max_batch for r in results.values())
            n, trials = floor, 1
            if floor > 0 and book.fits("auto", floor + 1):  # a mixed plan may reach past every baseline
                n, more = largest(lambda k: k <= floor or book.fits("auto", k), floor + 1)
                trials += more
            results["auto"] = StrategyResult("auto", n, trials=trials)
        else:
            n, trials = largest(lambda k: book.fits("auto", k), guess)
            results["auto"] = StrategyResult("auto", n, trials=trials)
    plain_batch = results["none"].max_batch
    if "none" not in names:
        del results["none"]
    points = {k * plain_batch for k in MULTIPLES} | {r.max_batch for r in results.values()}
    points |= {batch} if batch else set()
    points.discard(0)
    for r in results.values():
        frugal = [b for b in results.values() if b.name != "auto" and b.max_batch == r.max_batch]
        if r.name == "auto" and frugal:  # the same wall as the most frugal baseline's
            r.blocker = frugal[0].blocker or book.outcome(frugal[0].name, r.max_batch + 1).why
        else:
            r.blocker = book.outcome(r.name, r.max_batch + 1).why
    for n in sorted(points):
        t0 = time.perf_counter()
        for r in results.values():
            if n <= r.max_batch:  # feasibility is monotone in the batch: past the largest, nothing fits
                r.points[n] = Point.of(book.outcome(r.name, n), n)
            else:
                r.points[n] = Point(n, False, why=f"past its largest batch ({r.max_batch})")
        book.forget(set())
        say(f"batch {n}: {len(results)} strategies compared ({time.perf_counter() - t0:.1f} s)")
    return results
