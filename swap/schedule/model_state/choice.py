"""Choosing a model-state plan by simulating it: placements within a device room, the weights placed in the
activation sequence and scheduled under the budget, the iteration simulated with its host steps, the fastest
kept. Pure: the runtime (its profiled sequence) and the forecast (a captured one) call the same functions.

Note [Choosing model state]
``plan_model_state`` places buckets within a room greedily (Note [Model-state placements]); which room, and
how much of it resident buckets may take, is a trade the bytes alone do not settle: room for model state is
room the activations lose (more swapping or recomputing), resident buckets save their host steps and link
traffic but take 16 bytes a parameter where a host master takes 2. So ``choose_model_state`` tries rooms
(shares of what the activations leave) and resident shares, places each plan in the sequence
(``place``: ``with_weights``, then the window schedule whose simulated step is fastest), simulates it with the
host steps timed as the runtime times them (``runtime_timing``), and keeps the fastest that fits the host's memory
(model state, rollback copies, and the swapped activations).

Note [Speculation as the runtime decides it]
The runtime speculates by default (Note [When to speculate] in swap/runtime/model_state/speculation.py): where the
rollback copies of every parameter it offloads fit the host memory beside the model state, every offloaded
bucket's host step starts in the last backward before ``opt.step()``, once its gradients are on the host. The
runtime decides once, before it places anything, on every parameter streamed (its conservative plan), so the
forecast decides with the same function (``ledger.speculates``) on the same bytes: the all-streamed plan's host
bytes (``predict_host``'s total: what the runtime predicted) and ``ledger.rollback_bytes`` of every bucket, against
the host's memory; not on whether speculating is faster. Where it speculates, every offloaded bucket is staged
(``with_speculation``), the plan's host bytes count the copies of the offloaded ones, and the step is simulated
``"speculative"`` (its copies priced in the host step: ``ModelStatePrices.save_seconds``); else ``"before_use"``.
The runtime does not count the swapped activations when it decides (they are the activation pool's): neither does
this; the chooser then refuses a plan whose model state, copies and swapped activations exceed the host's memory.
A speculation that fails (clipping that binds, a GradScaler's inf, another micro-batch) costs the host work thrown
away and a restore; the forecast assumes every speculation holds and prices no failure.

Note [One chooser]
The rooms and resident shares are tried in one place, ``candidates``: per room, per resident share (one share
unless the placement is "auto"), ``plan_model_state``'s plan or its refusal, a room's shares stopping at the
first plan that makes every bucket resident (a larger share places them the same). ``choose_model_state`` (the
runtime's chooser, priced by what the manager measured: swap/runtime/model_state/wiring.py) and the forecast's
``ours`` (swap/forecast/offload.py, which also plans the activations per room and tries host shares) both
iterate it; each only says which rooms (``rooms_of``: shares of what the activations leave, or of the budget on
the forecast's grid) and how a candidate is placed and judged.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Optional

from ...units import fmt_bytes
from ..budget import InfeasibleBudget
from ..scheduler import Schedule
from ..sequence import Sequence
from ..simulator import choose_window
from .ledger import ModelStateDoesNotFit, host_bytes_of, plan_bytes, rollback_bytes, speculates
from .placing import plan_model_state
from .plan import Bucket, ModelStatePlan, Placement, placement_named
from .sim import ModelStatePrices, ModelStateSim, simulate_model_state
from .weights import BucketUses, Weighted, with_weights

ROOM_SHARES = (0.15, 0.3, 0.45, 0.6)  # of what the activations leave: rooms tried (Note [Choosing model state])
RESIDENT_SHARES = (0.0, 0.5, 1.0)  # of a room: the most its resident buckets may take


@dataclass(frozen=True)
class Candidate:
    """A plan ``candidates`` offers: the room and resident share it was made for, and the plan, or why
    ``plan_model_state`` refused to make one."""

    room: int
    resident: float  # of the room: the most its resident buckets may take
    plan: Optional[ModelStatePlan]
    refused: Optional[ModelStateDoesNotFit] = None


def rooms_of(left: int, shares: Seq[float] = ROOM_SHARES, whole: bool = False) -> list[int]:
    """The device rooms to try: ``shares`` of ``left`` (what the activations leave), ascending and distinct, and
    with ``whole`` also ``left`` itself; ``[max(0, left)]`` when no share of it is positive."""
    rooms = {int(share * left) for share in shares if share * left > 0}
    if whole and left > 0:
        rooms.add(left)
    return sorted(rooms) or [max(0, left)]


def candidates(buckets: Seq[Bucket], rooms: Seq[int], *, placement: str = "auto",
               resident_shares: Seq[float] = RESIDENT_SHARES, in_flight: int = 2, host_memory: Optional[int] = None,
               accumulation: int = 0) -> Iterator[Candidate]:  # fmt: skip
    """Plans over ``rooms`` x ``resident_shares`` (Note [One chooser]), in that order; ``placement`` and the
    rest as ``plan_model_state``'s. A room's shares stop after the first plan that makes every bucket resident,
    and after its first plan when ``placement`` is not "auto" (whose only share is 1.0)."""
    mode = placement_named(placement, "placement")
    for room in rooms:
        for resident in resident_shares if mode == "auto" else (1.0,):
            try:
                plan = plan_model_state(buckets, room, placement=mode, resident_room=int(resident * room),
                                        in_flight=in_flight, host_memory=host_memory,
                                        accumulation=accumulation)  # fmt: skip
            except ModelStateDoesNotFit as e:
                yield Candidate(room, resident, None, e)
                continue
            yield Candidate(room, resident, plan)
            if mode != "auto" or all(p == Placement.RESIDENT for p in plan.placements):
                break


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
    resident: float = 1.0  # of the room: the most its resident buckets could take (``candidates``)


def with_bytes(buckets: Seq[Bucket], plan: ModelStatePlan, in_flight: int = 2,
               accumulation: int = 0) -> ModelStatePlan:  # fmt: skip
    """``plan`` with its device, host and pinned bytes counted (``plan_bytes``, rollback copies and the
    ``accumulation`` buffer included)."""
    slots = plan.staging_slots if plan.speculate else 0
    plan.device_bytes, plan.host_bytes, plan.pinned_bytes = plan_bytes(buckets, plan.placements, in_flight, slots,
                                                                       accumulation)  # fmt: skip
    return plan


def with_speculation(buckets: Seq[Bucket], plan: ModelStatePlan, host_memory: Optional[int], in_flight: int = 2,
                     accumulation: int = 0) -> Optional[ModelStatePlan]:  # fmt: skip
    """``plan`` with every offloaded bucket's host step speculative, where the runtime would speculate (Note
    [Speculation as the runtime decides it]): the rollback copies of every bucket fit ``host_memory`` (None: no
    limit) beside the model state of every bucket streamed, with the ``accumulation`` buffer. None where they do
    not, or no bucket is offloaded."""
    offloaded = sum(p != Placement.RESIDENT for p in plan.placements)
    if not offloaded:
        return None
    every = sum(host_bytes_of(b, Placement.STREAMED)[0] for b in buckets) + accumulation
    rollback = rollback_bytes((b.master_bytes, b.state_bytes) for b in buckets)
    if host_memory is not None and not speculates(every, rollback, host_memory):
        return None
    where = "" if host_memory is None else f" in {fmt_bytes(host_memory)} of host memory"
    note = f"speculative host steps: rollback copies of {fmt_bytes(rollback)} fit beside {fmt_bytes(every)}{where}"
    spec = replace(plan, speculate=True, staging_slots=offloaded, notes=[*plan.notes, note])
    return with_bytes(buckets, spec, in_flight, accumulation)


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


def runtime_timing(placed: Placed, buckets: Seq[Bucket], uses: Seq[BucketUses], plan: ModelStatePlan,
                   prices: ModelStatePrices, host_memory: Optional[int], in_flight: int = 2,
                   speculative: bool = True,
                   accumulation: int = 0) -> tuple[ModelStatePlan, str, ModelStateSim]:  # fmt: skip
    """The host steps timed as the runtime times them (Note [Speculation as the runtime decides it]): speculative
    where ``speculative`` (the runtime's default; False: turned off) and ``with_speculation`` says the copies fit
    ``host_memory``, else before use: (the plan, its timing, its simulated step)."""
    spec = with_speculation(buckets, plan, host_memory, in_flight, accumulation) if speculative else None
    if spec is not None:
        return spec, "speculative", simulate_placed(placed, buckets, uses, spec, prices, "speculative", in_flight)
    return plan, "before_use", simulate_placed(placed, buckets, uses, plan, prices, "before_use", in_flight)


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
    speculative: bool = True,
    accumulation: int = 0,
) -> ModelStateChoice:
    """The fastest model-state plan for the activation sequence ``seq`` (its ``nonswap`` without model state)
    under ``budget`` (Note [Choosing model state]). ``rooms``: device rooms to try (default ``ROOM_SHARES`` of
    what the activations leave: the budget less the largest ``nonswap``, ``rooms_of``); ``placement`` as
    ``plan_model_state``; ``speculative``: host steps speculative where the runtime would speculate (Note
    [Speculation as the runtime decides it]; False: as a runtime with speculation turned off); ``accumulation``:
    the gradient-accumulation buffer's host bytes (``ledger.accumulation_bytes``). The plans tried are
    ``candidates``' (Note [One chooser]).

    Raises ``ModelStateDoesNotFit`` (no placement fits a room, or the host's memory) or ``InfeasibleBudget``
    (every placement's schedule exceeds the budget), saying what was tried."""
    if rooms is None:
        rooms = rooms_of(budget - max(seq.nonswap, default=0))
    best: Optional[ModelStateChoice] = None
    last: Optional[Exception] = None
    for c in candidates(buckets, rooms, placement=placement, resident_shares=resident_shares, in_flight=in_flight,
                        host_memory=host_memory, accumulation=accumulation):  # fmt: skip
        if c.plan is None:
            last = c.refused
            continue
        try:
            placed = place(seq, buckets, uses, c.plan, budget, prices, in_flight=in_flight, fetch_bytes=fetch_bytes)
        except InfeasibleBudget as e:
            last = e
            continue
        plan, timing, sim = runtime_timing(placed, buckets, uses, c.plan, prices, host_memory, in_flight,
                                           speculative, accumulation)  # fmt: skip
        host = plan.host_bytes + placed.pool
        if host_memory is not None and host > host_memory:
            what = f"model state and swapped activations need {host} bytes of host memory"
            last = ModelStateDoesNotFit("host", host, host_memory, what)
            continue
        if best is None or sim.step_time < best.sim.step_time:
            best = ModelStateChoice(plan, placed, sim, timing, c.room, host, c.resident)
    if best is None:
        assert last is not None
        raise last
    return best
