"""How the model-state runtime joins a manager's executor: its weights become variables of the one plan, its
prefetches ask the budget, and, with placement "auto", its placements are chosen from what the activation
plan leaves, by the one chooser the forecast calls, priced by what the manager measured (swap.runtime.manager
builds these; the runtime itself knows nothing of the executor)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ...schedule.budget import InfeasibleBudget
from ...schedule.model_state import (
    Bucket,
    BucketUses,
    ModelStateChoice,
    ModelStateDoesNotFit,
    ModelStatePlan,
    ModelStatePrices,
    Placement,
    choose_model_state,
    plan_model_state,
)
from ...schedule.model_state.choice import rooms_of
from ...schedule.model_state.weights import without_weights
from ...schedule.sequence import Sequence
from ...units import fmt_bytes
from ..activations.executor import DECLINED, PLANNED, Executor
from ..activations.hooks import SavedTensorHooks
from ..machine.memory import DeviceMemory
from .runtime import ModelStateRuntime
from .weight_hooks import ParamPacked


def attach(ms: ModelStateRuntime, executor: Executor, engine: Any, hooks: SavedTensorHooks, memory: DeviceMemory,
           budget: int) -> None:  # fmt: skip
    """Starts ``ms`` on ``executor``'s copy engine, before the operator profiler (its dispatch mode must sit
    above the guard's), with each use of a bucket a step of the executor's iteration (Note [Clean variables at
    run time])."""
    counters = executor.counters
    ms.start(engine, hooks.own_work, fits(executor, memory, budget),
             lambda: (counters.swapped_in_bytes, counters.swapped_out_bytes), memory.window_peak)  # fmt: skip
    executor.entry_note = entry_note(ms)
    hooks.manage_params(ms.weight_hooks, ParamPacked)
    streamer = ms.streamer
    streamer.step_hook = lambda bucket, nbytes, module: executor.use_clean(bucket, nbytes, streamer, module)
    executor.clean_mover = streamer

    def boundary() -> None:  # an iteration begun by a bucket's use is one the saved-tensor hooks never see begin
        if hooks.listener is not None:
            hooks.listener.boundary()

    executor.on_boundary = boundary


def entry_note(ms: ModelStateRuntime) -> str:
    """What the device held at entry because of the model (Note [The memory before the first iteration] in
    swap.runtime.activations.executor; Note [The model as it enters] in swap.runtime.model_state.storage)."""
    entries = ms.entries
    built = sum(e.master_nbytes for e in entries)
    first = next((e.nbytes for e in entries if e.dtype != e.master_dtype), 0)
    also = f", plus {fmt_bytes(first)} of the first compute copy made beside them" if first else ""
    return (f"the model entered on the device with {fmt_bytes(built)} of weights as built{also}, which the manager "
            "moved to the host as it started (the manager takes the model on its device)")


def fits(executor: Executor, memory: DeviceMemory, budget: int) -> Callable[[int], bool]:
    """Whether ``nbytes`` more on the device now keeps ``budget``, with room for the most a step of the last
    profile allocated on top of what was live (weights are prefetched only then)."""

    def check(nbytes: int) -> bool:
        seq = executor.lifecycle.latest
        if seq is None:
            return False
        return memory.current() + nbytes + max(seq.transient, default=0) <= budget

    return check


# Note [Placing model state under the budget]
# With placement "auto" every bucket starts streamed, the placement that needs least of the device, so
# the profiling iterations keep the budget whatever the model. Once the activations are planned (or the
# manager declined to swap them), what the plan leaves of the budget at its tightest step is the room
# (``schedule.peak`` was measured with the streamed weights in flight, so those bytes are counted twice:
# the room errs small). The runtime then chooses as the forecast does, with the one chooser (Note [One
# chooser] in swap/schedule/model_state/choice.py): ``choose_model_state`` tries ``ROOM_SHARES`` of that room
# and the room itself (the plan greedy by bytes made alone before, still among the candidates) times
# ``RESIDENT_SHARES``, places each plan in the profiled activations (the buckets taken out of the profile:
# Note [Weights out of a profile]), simulates it with the host steps timed as the runtime times them
# (speculative where it decided to speculate, Note [When to speculate]), and keeps the fastest. It is
# priced by what the manager measured (``measured_prices``): the link's bandwidth each way from the copies made
# so far, the host step's seconds a byte from the host worker's timings, each step's compute from the profile;
# what was not measured yet takes a named default (``DEFAULT_LINK_BANDWIDTH``, ``DEFAULT_HOST_STEP_RATE``), and
# the report says which (``model_state["choice"]``). Resident buckets' device steps are not priced (none ran
# yet). Where the chooser finds no plan (no profile, its buckets not the model's, no schedule keeps the budget),
# ``plan_model_state`` fills the room with resident buckets first (forward order: the last of the backward pass,
# whose host step nothing could hide), then host masters, and the note says why. Applied at that optimizer step
# (Note [Changing placements]); the activation plan then grows by what became resident (Note [Learning from an
# overrun] in swap.runtime.activations.lifecycle).
DEFAULT_LINK_BANDWIDTH = 16e9  # bytes/s each way, PCIe 4.0 x16's practical rate: no copy measured yet
DEFAULT_HOST_STEP_RATE = 4e9  # bytes/s of a host step's masters, gradients and state: no host step timed yet


@dataclass
class Measured:
    """``measured_prices``' result: the prices and, per price, whether it was measured or a default."""

    prices: ModelStatePrices
    figures: dict[str, float]  # h2d/d2h bytes/s, host step seconds a byte
    measured: list[str] = field(default_factory=list)
    defaults: list[str] = field(default_factory=list)


def measured_prices(buckets: list[Bucket], engine: Any, host_seconds: dict[int, float]) -> Measured:
    """Model-state prices from what the manager measured (Note [Placing model state under the budget]): the
    copy engine's bandwidths, and the host step's seconds a byte of the masters, gradients and state it stepped
    (``host_seconds``: the host worker's seconds by optimizer step, every bucket offloaded; the first, which makes
    the optimizer state, only when it is the one timed). A cast (mixed precision) is priced at that rate too; a
    speculative step's rollback copy is in the seconds measured where the runtime speculated (no
    ``save_seconds``)."""
    out = Measured(ModelStatePrices(0.0, 0.0, ()), {})
    bw = {}
    for name, meter in (("h2d_bandwidth", getattr(engine, "h2d_bw", None)),
                        ("d2h_bandwidth", getattr(engine, "d2h_bw", None))):  # fmt: skip
        bw[name] = meter.rate(0.0) if meter is not None else 0.0
        (out.measured if bw[name] > 0 else out.defaults).append(name)
        bw[name] = bw[name] or DEFAULT_LINK_BANDWIDTH
    stepped = sum(b.master_bytes + b.grad_bytes + b.state_bytes for b in buckets if b.grad_bytes)
    timed = [s for _k, s in sorted(host_seconds.items()) if s > 0]
    per_byte = min(timed[1:] or timed) / stepped if timed and stepped else 0.0
    (out.measured if per_byte > 0 else out.defaults).append("host_step_seconds_per_byte")
    per_byte = per_byte or 1 / DEFAULT_HOST_STEP_RATE
    host = tuple(per_byte * (b.master_bytes + b.grad_bytes + b.state_bytes) if b.grad_bytes else 0.0
                 for b in buckets)  # fmt: skip
    mixed = any(b.mixed for b in buckets)
    cast = tuple(per_byte * (b.master_bytes + b.weight_bytes) for b in buckets) if mixed else ()
    out.prices = ModelStatePrices(bw["h2d_bandwidth"], bw["d2h_bandwidth"], host, cast_seconds=cast,
                                  cast_once=mixed)  # fmt: skip
    out.figures = {**bw, "host_step_seconds_per_byte": per_byte}
    return out


def choose(seq: Optional[Sequence], buckets: list[Bucket], room: int, budget: int, measured: Measured,
           placement: str = "auto", accumulation: int = 0,
           speculative: bool = False) -> tuple[ModelStateChoice, list[BucketUses], Sequence]:  # fmt: skip
    """``choose_model_state`` on the profiled ``seq`` (its buckets taken out: ``without_weights``) for rooms up
    to ``room`` (``rooms_of(room, whole=True)``), the host steps speculative where ``speculative`` (the runtime
    decided it already: Note [When to speculate]): (the choice, the buckets' uses, the activations). Raises
    ``ValueError`` for a profile the chooser cannot read, else as ``choose_model_state``."""
    if seq is None:
        raise ValueError("no profiled iteration")
    acts, uses = without_weights(seq, buckets)
    choice = choose_model_state(acts, buckets, uses, budget, measured.prices, placement=placement,
                                rooms=rooms_of(room, whole=True), accumulation=accumulation,
                                speculative=speculative)  # fmt: skip
    return choice, uses, acts


def placer(executor: Executor, memory: DeviceMemory, budget: int, note: Callable[[str], None], placement: str = "auto",
           accumulation: int = 0, engine: Any = None, runtime: Optional[ModelStateRuntime] = None
           ) -> Callable[[list[Bucket]], Optional[ModelStatePlan]]:  # fmt: skip
    """``ModelStateRuntime.decide`` for ``placement`` "auto" (or "host_master": every bucket, where it fits):
    None while the activations are still profiled (asked again at the next optimizer step), then the fastest
    placements for what their plan leaves (Note [Placing model state under the budget]; ``accumulation``: the
    host's gradient-accumulation buffer, in its host bytes), priced by ``engine``'s copies and ``runtime``'s host
    steps, the choice kept as ``runtime.choice`` for the report."""

    def decide(buckets: list[Bucket]) -> Optional[ModelStatePlan]:
        ex = executor
        if ex.mode == PLANNED and ex.schedule is not None:
            peak = ex.schedule.peak
        elif ex.mode == DECLINED and ex.counters.iterations >= 2:
            peak = memory.peak
        else:
            return None
        room = max(0, budget - peak)
        measured = measured_prices(buckets, engine, runtime.stepper.seconds if runtime is not None else {})
        report: dict[str, Any] = {"room": room, "prices": dict(measured.figures), "measured": measured.measured,
                                  "defaults": measured.defaults}  # fmt: skip
        try:
            speculative = runtime is not None and runtime.speculate
            choice, _uses, acts = choose(ex.lifecycle.latest, buckets, room, budget, measured, placement,
                                         accumulation, speculative)  # fmt: skip
            plan = choice.plan
            report.update(chooser="choose_model_state", plan_room=choice.room, resident_share=choice.resident,
                          simulated_step_seconds=choice.sim.step_time, timing=choice.timing, bound=choice.sim.bound,
                          compute_seconds=sum(acts.compute))  # fmt: skip
            plan.notes.append(f"the fastest of the chooser's plans, {choice.sim.step_time:.3g} s a step simulated "
                              f"({choice.sim.bound}-bound)")  # fmt: skip
            if measured.defaults:
                plan.notes.append("priced with defaults for " + ", ".join(measured.defaults) + " (not measured yet)")
        except (ValueError, ModelStateDoesNotFit, InfeasibleBudget) as e:
            why = str(e).split(". ")[0]
            report.update(chooser="plan_model_state", why=why)
            try:
                plan = plan_model_state(buckets, room, placement=placement, accumulation=accumulation)
                plan.notes.append(f"placed by bytes, the chooser found no plan ({why})")
            except ModelStateDoesNotFit as e:
                plan = ModelStatePlan.uniform(len(buckets), Placement.STREAMED)
                plan.notes.append(f"every bucket stays streamed: {e}")
        report["placements"] = {p.value: n for p in Placement if (n := plan.placements.count(p))}
        if runtime is not None:
            runtime.choice = report
        note("model state: " + "; ".join(plan.notes))
        return plan

    return decide
