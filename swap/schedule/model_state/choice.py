"""Choosing a model-state plan by simulating it: placements within a device room, the weights placed in the
activation sequence and scheduled under the budget, the iteration simulated with its host steps, the fastest
kept. Pure: the runtime (its profiled sequence) and the forecast (a captured one) call the same functions.

Note [Choosing model state]
``plan_model_state`` places buckets within a room greedily (Note [Model-state placements]); which room, and
how much of it resident buckets may take, is a trade the bytes alone do not settle: room for model state is
room the activations lose (more swapping or recomputing), resident buckets save their host steps and link
traffic but take 16 bytes a parameter where a host master takes 2. So ``choose_model_state`` tries rooms
(shares of what the activations leave) and resident shares, places each plan in the sequence
(``place``: ``with_weights``, then the window schedule whose simulated step is fastest), simulates it with
host steps before use (what the runtime does: it steps after ``opt.step()``) and, asked for with
``speculative=True`` where the host has memory for staging slots, speculative (``with_speculation``: a
mechanism the runtime does not have yet, issue 37; no forecast row prices it), and keeps the fastest that
fits the host's memory (model state, staging, and the swapped activations).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Optional

from ..budget import InfeasibleBudget
from ..scheduler import Schedule
from ..sequence import Sequence
from ..simulator import choose_window
from .ledger import ModelStateDoesNotFit, plan_bytes
from .placing import plan_model_state
from .plan import Bucket, ModelStatePlan, Placement, placement_named
from .sim import ModelStatePrices, ModelStateSim, simulate_model_state
from .weights import BucketUses, Weighted, with_weights

ROOM_SHARES = (0.15, 0.3, 0.45, 0.6)  # of what the activations leave: rooms tried (Note [Choosing model state])
RESIDENT_SHARES = (0.0, 0.5, 1.0)  # of a room: the most its resident buckets may take


@dataclass
class Placed:
    """A model-state plan placed in an activation sequence and scheduled under the budget (``place``)."""

    weighted: Weighted
    schedule: Schedule
    pool: int  # host bytes of the activations the schedule swaps out (each once)


@dataclass
class ModelStateChoice:
    """``choose_model_state``'s result: the plan, where it sits in the sequence, and its simulated step."""

    plan: ModelStatePlan
    placed: Placed
    sim: ModelStateSim
    timing: str  # "before_use" or "speculative"
    room: int  # the device room the plan was made for
    host_bytes: int  # model state, staging and swapped activations


def with_bytes(buckets: Seq[Bucket], plan: ModelStatePlan, in_flight: int = 2) -> ModelStatePlan:
    """``plan`` with its device, host and pinned bytes counted (``plan_bytes``, staging included)."""
    slots = plan.staging_slots if plan.speculate else 0
    plan.device_bytes, plan.host_bytes, plan.pinned_bytes = plan_bytes(buckets, plan.placements, in_flight, slots)
    return plan


def with_speculation(buckets: Seq[Bucket], plan: ModelStatePlan, spare: int,
                     in_flight: int = 2) -> Optional[ModelStatePlan]:  # fmt: skip
    """``plan`` with speculative host steps staged in ``spare`` host bytes less a 5% margin: as many offloaded
    buckets as fit, in backward order (``ModelStatePlan.speculated``); None when not one does."""
    room, slots = int(spare * 0.95), 0
    for b, p in zip(reversed(buckets), reversed(plan.placements)):
        if p == Placement.RESIDENT:
            continue
        if b.master_bytes + b.state_bytes > room:
            break
        room -= b.master_bytes + b.state_bytes
        slots += 1
    if slots < 1:
        return None
    return with_bytes(buckets, replace(plan, speculate=True, staging_slots=slots, notes=list(plan.notes)), in_flight)


def place(seq: Sequence, buckets: Seq[Bucket], uses: Seq[BucketUses], plan: ModelStatePlan, budget: int,
          prices: ModelStatePrices, *, in_flight: int = 2, fetch_bytes: Optional[Seq[int]] = None,
          holds: Optional[Seq[int]] = None, compute: Optional[Seq[float]] = None) -> Placed:  # fmt: skip
    """``plan`` in ``seq`` (``with_weights``; arguments as there), scheduled by the window policy with the
    window whose simulated step is fastest (``choose_window``). Raises ``InfeasibleBudget`` when no schedule
    keeps ``budget``."""
    w = with_weights(seq, buckets, uses, plan, in_flight, fetch_bytes, holds, compute)
    _window, schedule, _ = choose_window(w.seq, budget, prices.h2d_bandwidth, prices.d2h_bandwidth)
    pool = sum(w.seq.sizes[v] for v in {v for step in schedule.swap_out for v in step} if not w.seq.clean[v])
    return Placed(w, schedule, pool)


def simulate_placed(placed: Placed, buckets: Seq[Bucket], uses: Seq[BucketUses], plan: ModelStatePlan,
                    prices: ModelStatePrices, timing: str, in_flight: int = 2) -> ModelStateSim:  # fmt: skip
    """``simulate_model_state`` of a placed plan."""
    return simulate_model_state(placed.weighted, placed.schedule, buckets, uses, plan, prices, timing=timing,
                                in_flight=in_flight)  # fmt: skip


def fastest_timing(placed: Placed, buckets: Seq[Bucket], uses: Seq[BucketUses], plan: ModelStatePlan,
                   prices: ModelStatePrices, host_memory: Optional[int], in_flight: int = 2,
                   speculative: bool = False) -> tuple[ModelStatePlan, str, ModelStateSim]:  # fmt: skip
    """Host steps before use, or (``speculative``) speculative where ``host_memory`` has room to stage them and
    it is faster: (the plan, its timing, its simulated step). Note [Choosing model state]."""
    sim = simulate_placed(placed, buckets, uses, plan, prices, "before_use", in_flight)
    if host_memory is None or not speculative:
        return plan, "before_use", sim
    spec = with_speculation(buckets, plan, host_memory - plan.host_bytes - placed.pool, in_flight)
    if spec is not None:
        trial = simulate_placed(placed, buckets, uses, spec, prices, "speculative", in_flight)
        if trial.step_time < sim.step_time:
            return spec, "speculative", trial
    return plan, "before_use", sim


def choose_model_state(
    seq: Sequence,
    buckets: Seq[Bucket],
    uses: Seq[BucketUses],
    budget: int,
    prices: ModelStatePrices,
    *,
    placement: str = "auto",
    rooms: Optional[Seq[int]] = None,
    resident_shares: Seq[float] = RESIDENT_SHARES,
    host_memory: Optional[int] = None,
    in_flight: int = 2,
    fetch_bytes: Optional[Seq[int]] = None,
    speculative: bool = False,
) -> ModelStateChoice:
    """The fastest model-state plan for the activation sequence ``seq`` (its ``nonswap`` without model state)
    under ``budget`` (Note [Choosing model state]). ``rooms``: device rooms to try (default ``ROOM_SHARES`` of
    what the activations leave: the budget less the largest ``nonswap``); ``placement`` as ``plan_model_state``;
    ``speculative``: also try host steps during the backward (not what the runtime does today).

    Raises ``ModelStateDoesNotFit`` (no placement fits a room, or the host's memory) or ``InfeasibleBudget``
    (every placement's schedule exceeds the budget), saying what was tried."""
    mode = placement_named(placement, "placement")
    left = budget - max(seq.nonswap, default=0)
    if rooms is None:
        rooms = sorted({int(share * left) for share in ROOM_SHARES if share * left > 0}) or [max(0, left)]
    best: Optional[ModelStateChoice] = None
    last: Optional[Exception] = None
    for room in rooms:
        for resident in resident_shares if mode == "auto" else (1.0,):
            try:
                plan = plan_model_state(buckets, room, placement=mode, resident_room=int(resident * room),
                                        in_flight=in_flight, host_memory=host_memory)  # fmt: skip
                placed = place(seq, buckets, uses, plan, budget, prices, in_flight=in_flight, fetch_bytes=fetch_bytes)
            except (ModelStateDoesNotFit, InfeasibleBudget) as e:
                last = e
                continue
            plan, timing, sim = fastest_timing(placed, buckets, uses, plan, prices, host_memory, in_flight,
                                               speculative)  # fmt: skip
            host = plan.host_bytes + placed.pool
            if host_memory is not None and host > host_memory:
                what = f"model state and swapped activations need {host} bytes of host memory"
                last = ModelStateDoesNotFit("host", host, host_memory, what)
                continue
            if best is None or sim.step_time < best.sim.step_time:
                best = ModelStateChoice(plan, placed, sim, timing, room, host)
            if mode != "auto" or all(p == Placement.RESIDENT for p in plan.placements):
                break
    if best is None:
        assert last is not None
        raise last
    return best
