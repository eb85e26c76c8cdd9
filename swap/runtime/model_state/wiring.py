"""How the model-state runtime joins a manager's executor: its weights become variables of the one plan, its
prefetches ask the budget, and, with placement "auto", its placements are chosen from what the activation
plan leaves (swap.runtime.manager builds these; the runtime itself knows nothing of the executor)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from ...schedule.model_state import Bucket, ModelStateDoesNotFit, ModelStatePlan, Placement, plan_model_state
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
# the room errs small); ``plan_model_state`` fills it with resident buckets first (forward order: the last
# of the backward pass, whose host step nothing could hide), then host masters. Applied at that optimizer
# step (Note [Changing placements]); the activation plan then grows by what became resident
# (Note [Learning from an overrun] in swap.runtime.activations.lifecycle).
def placer(executor: Executor, memory: DeviceMemory, budget: int, note: Callable[[str], None], placement: str = "auto",
           accumulation: int = 0) -> Callable[[list[Bucket]], Optional[ModelStatePlan]]:  # fmt: skip
    """``ModelStateRuntime.decide`` for ``placement`` "auto" (or "host_master": every bucket, where it fits):
    None while the activations are still profiled (asked again at the next optimizer step), then the placements
    for what their plan leaves (``accumulation``: the host's gradient-accumulation buffer, in its host bytes)."""

    def decide(buckets: list[Bucket]) -> Optional[ModelStatePlan]:
        ex = executor
        if ex.mode == PLANNED and ex.schedule is not None:
            peak = ex.schedule.peak
        elif ex.mode == DECLINED and ex.counters.iterations >= 2:
            peak = memory.peak
        else:
            return None
        try:
            plan = plan_model_state(buckets, max(0, budget - peak), placement=placement, accumulation=accumulation)
        except ModelStateDoesNotFit as e:
            plan = ModelStatePlan.uniform(len(buckets), Placement.STREAMED)
            plan.notes.append(f"every bucket stays streamed: {e}")
        note("model state: " + "; ".join(plan.notes))
        return plan

    return decide
