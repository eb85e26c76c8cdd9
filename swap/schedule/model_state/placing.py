"""``plan_model_state``: where each bucket lives and is updated within a device room, greedily, by bytes (Note
[Model-state placements] in ``plan``, Note [Model-state bytes] in ``ledger``). ``choice.choose_model_state`` tries
rooms and resident shares with it and keeps the fastest simulated plan."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from ...units import fmt_bytes
from .ledger import ModelStateDoesNotFit, device_bytes_of, plan_bytes
from .plan import Bucket, ModelStatePlan, Placement, UpdateSite, placement_named


def plan_model_state(
    buckets: Sequence[Bucket],
    room: int,
    *,
    placement: str = "auto",
    resident_room: Optional[int] = None,
    host_memory: Optional[int] = None,
    in_flight: int = 2,
    speculate: bool = False,
    staging_slots: int = 2,
    accumulation: int = 0,
) -> ModelStatePlan:
    """Where each bucket lives and is updated, within ``room`` device bytes (what the activation plan leaves).

    ``placement`` (Note [One vocabulary for model state]): "resident" (every bucket on the device, stepped
    there), "streamed" (every bucket streamed, stepped on the host: the conservative plan), "host_master" (every
    bucket a host master: a device compute copy, stepped on the host) or "auto": the buckets first in forward order
    are made resident (they are the last of the backward pass, whose host step could hide behind nothing)
    while ``resident_room`` (default: all of ``room``) allows; of the rest, as many as fit keep a device
    compute copy (``HOST_MASTER``: one weight fetch a step fewer than streaming), in forward order; the others
    are streamed; buckets in mixed precision (``Bucket.mixed``) are never made resident (and "resident" is
    refused for them). ``host_memory``: host bytes model state may take (None: no limit). ``speculate``: stage
    speculative host steps in ``staging_slots`` slots; ``accumulation``: the gradient-accumulation buffer's host
    bytes (``ledger.accumulation_bytes``). Bytes are counted as Note [Model-state bytes] says.

    Raises ``ModelStateDoesNotFit`` when even the plan that needs least of the device (or of the host)
    exceeds ``room`` (or ``host_memory``), naming the smallest that fits.

    ``device_bytes`` counts by bucket sizes alone; where the buckets' reads are known, ``weights.reserve`` gives
    the exact per-step figure (several gradients finished in one step, a module reading several buckets), and a
    schedule of ``weights.with_weights``' sequence is what holds the budget (``choice``).
    """
    mode = placement_named(placement, "placement")
    if room < 0:
        raise ValueError(f"room must not be negative, not {room}")
    if in_flight < 1:
        raise ValueError(f"in_flight must be at least 1 bucket, not {in_flight}")
    slots = staging_slots if speculate else 0
    n = len(buckets)
    mixed = any(b.mixed for b in buckets)  # Note [Mixed precision]: no bucket resident
    if mixed and mode == "resident":
        raise ValueError("buckets in mixed precision keep fp32 masters and optimizer state on the host, and "
                         "placement='resident' keeps them on the device: use placement='auto' or 'streamed'")
    if mode == "resident":
        placements = [Placement.RESIDENT] * n
    else:
        placements = [Placement.STREAMED] * n
        least = plan_bytes(buckets, placements, in_flight, slots)[0]
        if least > room:
            raise ModelStateDoesNotFit("device", least, room, (
                f"model state needs {fmt_bytes(least)} of the device even with every bucket streamed (the "
                f"buckets in flight and the gradients not yet copied out), and the activation plan leaves "
                f"{fmt_bytes(room)}: raise the budget by {fmt_bytes(least - room)}, or use smaller buckets"
            ))  # fmt: skip
        if mode == "auto":
            _fill(buckets, placements, room, room if resident_room is None else min(room, resident_room), in_flight)
        elif mode == "host_master":
            placements = [Placement.HOST_MASTER] * n
    device, host, pinned = plan_bytes(buckets, placements, in_flight, slots, accumulation)
    if device > room:
        raise ModelStateDoesNotFit("device", device, room, (
            f"every bucket {mode} needs {fmt_bytes(device)} of the device, and the activation plan leaves "
            f"{fmt_bytes(room)}: use placement='auto' or 'streamed' (the host keeps what does not fit), or raise "
            f"the budget by {fmt_bytes(device - room)}"))  # fmt: skip
    if host_memory is not None and host > host_memory:
        _refuse_host(buckets, placements, host, host_memory)
    sites = [UpdateSite.DEVICE if p == Placement.RESIDENT else UpdateSite.HOST for p in placements]
    plan = ModelStatePlan(placements, sites, speculate and any(s == UpdateSite.HOST for s in sites),
                          slots, device, host, pinned, room=room)  # fmt: skip
    counts = {p: placements.count(p) for p in Placement}
    plan.notes.append(
        f"{mode}: {counts[Placement.RESIDENT]} resident, {counts[Placement.HOST_MASTER]} host-master, "
        f"{counts[Placement.STREAMED]} streamed of {n} buckets; {fmt_bytes(device)} of {fmt_bytes(room)} device "
        f"room, {fmt_bytes(host)} host ({fmt_bytes(pinned)} pinned)")  # fmt: skip
    return plan


def _fill(buckets: Sequence[Bucket], placements: list[Placement], room: int, resident_room: int,
          in_flight: int) -> None:  # fmt: skip
    """``plan_model_state``'s "auto": a resident prefix of the buckets in forward order, then a host-master run,
    then streamed ones, each run as long as it fits. The in-flight reserve is that of the buckets left after
    each run (suffix maxima), so the device bytes are exact at every step and the fill is linear."""
    n = len(buckets)
    weight, grad = [0] * (n + 1), [0] * (n + 1)  # the largest weights / gradients from bucket i on
    for i in range(n - 1, -1, -1):
        weight[i] = max(weight[i + 1], buckets[i].weight_bytes)
        grad[i] = max(grad[i + 1], buckets[i].grad_bytes)
    held = k = 0  # device bytes between steps of buckets [0, k)
    while k < n and not buckets[k].mixed:
        cost = device_bytes_of(buckets[k], Placement.RESIDENT)
        if held + cost > resident_room or held + cost + in_flight * (weight[k + 1] + grad[k + 1]) > room:
            break
        held += cost
        placements[k] = Placement.RESIDENT
        k += 1
    j = k
    while j < n:
        cost = device_bytes_of(buckets[j], Placement.HOST_MASTER)
        if held + cost + in_flight * (weight[j + 1] + grad[k]) > room:
            break
        held += cost
        placements[j] = Placement.HOST_MASTER
        j += 1


def _refuse_host(buckets: Sequence[Bucket], placements: Sequence[Placement], host: int, host_memory: int) -> None:
    """``ModelStateDoesNotFit`` for the host: the smallest host that fits this plan, and about how many
    parameters fit ``host_memory`` at this plan's host bytes per offloaded parameter."""
    offloaded = sum(b.numel for b, p in zip(buckets, placements) if p != Placement.RESIDENT)
    per_param = host / offloaded if offloaded else 0.0
    fits = f"; about {host_memory / per_param / 1e9:.1f} B offloaded parameters fit {fmt_bytes(host_memory)}" \
        if per_param else ""
    raise ModelStateDoesNotFit("host", host, host_memory, (
        f"model state needs {fmt_bytes(host)} of host memory ({per_param:.1f} bytes per offloaded parameter: "
        f"masters, gradient buffers, optimizer state, copies) and {fmt_bytes(host_memory)} is available: the "
        f"smallest host that fits is {fmt_bytes(host)}{fits}; a larger budget keeps more on the device"))  # fmt: skip
