"""Model state in the plan: parameters packed into buckets, and where each bucket's weights, gradients,
optimizer state and update live. Pure data shared by the runtime (which applies a plan) and the forecast (which
prices one); ``plan_model_state`` (same module) chooses a plan under a budget.

Note [Model-state placements]
A *bucket* is a group of parameters packed in the order the forward pass first reads them, of about
``bucket_bytes`` each (a parameter is never split; a shared parameter counts once; parameters no forward reads
go last). It is the unit of placement, of copies and of the host step. Its weights are placed one of three ways:

- ``RESIDENT``: weights, gradients and optimizer state stay on the device, and the user's optimizer steps them
  there (update site ``DEVICE``);
- ``HOST_MASTER``: the device keeps a compute copy of the weights between steps; the master weights, the
  gradients (copied out during the backward pass) and the optimizer state live on the host, which steps them;
  the updated weights go back to the device before their next forward use;
- ``STREAMED``: no device copy between uses. The window brings the weights in ahead of each use, forward and
  backward, like a saved activation, and drops them *clean* after (the host copy is the master, so nothing is
  written back); gradients, state and the step are the host's.

A bucket that is not ``RESIDENT`` is updated on the host (``HOST``).

Note [Model-state bytes]
What each placement holds, per bucket, on the device between steps and on the host (``device_bytes_of``,
``host_bytes_of``):

- ``RESIDENT``: device weights, gradients and state, and the master if it is a separate tensor (its bytes
  differ from the weights': fp32 masters of bf16 weights); nothing on the host.
- ``HOST_MASTER``: the device compute copy; on the host the master, a gradient buffer and the state, plus a
  copy in the compute dtype when the master has another dtype (what the update's H2D copy reads).
- ``STREAMED``: nothing on the device between uses; on the host as ``HOST_MASTER``.

Besides, while buckets move: streamed weights in flight (the one in use and the one arriving: ``in_flight``
of the largest streamed bucket), and gradients of offloaded buckets not yet copied out (``in_flight`` of the
largest). Speculative host steps stage (master, state) in ``staging_slots`` slots of the largest offloaded
bucket. Pinned are the bytes a copy engine reads or writes: gradient buffers, the H2D source (the compute
copy, or the master when there is none) and, when the master is that source, the staging slots' masters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple, Optional

from ..units import fmt_bytes


class Placement(str, Enum):
    """Where a bucket's weights live between uses (Note [Model-state placements])."""

    RESIDENT = "resident"
    HOST_MASTER = "host_master"
    STREAMED = "streamed"


class UpdateSite(str, Enum):
    """Where a bucket's optimizer step runs."""

    DEVICE = "device"
    HOST = "host"


@dataclass(frozen=True)
class Bucket:
    """One bucket of parameters (Note [Model-state placements]).

    Attributes:
        index: position in first-use order.
        params: the parameters' names (as ``model.named_parameters()`` gives them), in first-use order.
        numel: elements of all its parameters.
        weight_bytes: bytes of the weights as the model computes with them (the device copy).
        master_bytes: bytes of the master weights (equal to ``weight_bytes`` unless the master has another dtype).
        grad_bytes: bytes of the gradients.
        state_bytes: bytes of the optimizer state the bucket will have once stepped (e.g. AdamW: two tensors of
            the master's size, plus its step counters).
    """

    index: int
    params: tuple[str, ...]
    numel: int
    weight_bytes: int
    master_bytes: int
    grad_bytes: int
    state_bytes: int

    @property
    def separate_master(self) -> bool:
        """Whether the master is a tensor of its own (another dtype than the weights the model computes with)."""
        return self.master_bytes != self.weight_bytes


@dataclass
class ModelStatePlan:
    """Where each bucket lives and is updated, and what that costs in memory.

    Attributes:
        placements: one per bucket, in bucket order.
        update_sites: one per bucket: ``DEVICE`` only for ``RESIDENT`` buckets.
        speculate: whether host steps may start during the backward pass, before ``opt.step()`` confirms them
            (results staged, committed when confirmed, redone exactly when not).
        staging_slots: buckets the speculative host steps may hold staged at once (0 without speculation).
        device_bytes: the most device bytes model state takes under this plan (resident buckets, buckets in
            flight, gradients not yet copied out).
        host_bytes: host bytes model state takes (masters, gradient buffers, optimizer state, staging).
        pinned_bytes: the part of ``host_bytes`` that is page-locked.
        notes: why the plan is what it is, for the report.
    """

    placements: list[Placement]
    update_sites: list[UpdateSite]
    speculate: bool = False
    staging_slots: int = 0
    device_bytes: int = 0
    host_bytes: int = 0
    pinned_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.placements) != len(self.update_sites):
            raise ValueError(f"{len(self.placements)} placements but {len(self.update_sites)} update sites: "
                             "give one of each per bucket")  # fmt: skip
        for i, (p, u) in enumerate(zip(self.placements, self.update_sites)):
            if u == UpdateSite.DEVICE and p != Placement.RESIDENT:
                raise ValueError(f"bucket {i} is {p.value} but updated on the device: only resident buckets are")

    @classmethod
    def uniform(cls, n: int, placement: Placement) -> ModelStatePlan:
        """Every one of ``n`` buckets placed alike (``RESIDENT``: updated on the device; else on the host)."""
        site = UpdateSite.DEVICE if placement == Placement.RESIDENT else UpdateSite.HOST
        return cls([placement] * n, [site] * n)


MODES = ("auto", "resident", "offload")


class ModelStateDoesNotFit(ValueError):
    """No placement of the buckets fits: ``needed`` bytes of ``what`` ("device" or "host") against
    ``available``; the message says what would fit."""

    def __init__(self, what: str, needed: int, available: int, message: str) -> None:
        self.what, self.needed, self.available = what, needed, available
        super().__init__(message)


class ParamInfo(NamedTuple):
    """One parameter as the packer sees it (bytes per role, as in ``Bucket``)."""

    name: str
    numel: int
    weight_bytes: int
    master_bytes: int
    grad_bytes: int
    state_bytes: int


def pack_buckets(params: Sequence[ParamInfo], bucket_bytes: int = 32 << 20) -> list[Bucket]:
    """Packs ``params`` (already in first-use order, shared ones once, unread ones last) into buckets of
    about ``bucket_bytes`` of weights (Note [Model-state placements]): a parameter is never split, so a
    parameter larger than ``bucket_bytes`` is a bucket of its own."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, not {bucket_bytes}")
    buckets: list[Bucket] = []
    group: list[ParamInfo] = []

    def close() -> None:
        if group:
            buckets.append(Bucket(len(buckets), tuple(p.name for p in group), sum(p.numel for p in group),
                                  *(sum(getattr(p, f) for p in group) for f in ParamInfo._fields[2:])))  # fmt: skip
            group.clear()

    for p in params:
        if group and sum(q.weight_bytes for q in group) + p.weight_bytes > bucket_bytes:
            close()
        group.append(p)
    close()
    return buckets


def device_bytes_of(b: Bucket, placement: Placement) -> int:
    """Device bytes bucket ``b`` holds between steps under ``placement`` (Note [Model-state bytes])."""
    if placement == Placement.RESIDENT:
        return b.weight_bytes + b.grad_bytes + b.state_bytes + (b.master_bytes if b.separate_master else 0)
    return b.weight_bytes if placement == Placement.HOST_MASTER else 0


def host_bytes_of(b: Bucket, placement: Placement) -> tuple[int, int]:
    """(host bytes, pinned bytes) of bucket ``b`` under ``placement`` (Note [Model-state bytes])."""
    if placement == Placement.RESIDENT:
        return 0, 0
    copy = b.weight_bytes if b.separate_master else 0
    return b.master_bytes + b.grad_bytes + b.state_bytes + copy, b.grad_bytes + (copy or b.master_bytes)


def plan_bytes(buckets: Sequence[Bucket], placements: Sequence[Placement], in_flight: int = 2,
               staging_slots: int = 0) -> tuple[int, int, int]:  # fmt: skip
    """(device, host, pinned) bytes of model state under ``placements`` (Note [Model-state bytes])."""
    device = host = pinned = 0
    streamed = offloaded = staged = 0
    staged_pinned = 0
    for b, p in zip(buckets, placements):
        device += device_bytes_of(b, p)
        h, pin = host_bytes_of(b, p)
        host, pinned = host + h, pinned + pin
        if p == Placement.STREAMED:
            streamed = max(streamed, b.weight_bytes)
        if p != Placement.RESIDENT:
            offloaded = max(offloaded, b.grad_bytes)
            staged = max(staged, b.master_bytes + b.state_bytes)
            staged_pinned = max(staged_pinned, 0 if b.separate_master else b.master_bytes)
    device += in_flight * (streamed + offloaded)
    return device, host + staging_slots * staged, pinned + staging_slots * staged_pinned


def plan_model_state(
    buckets: Sequence[Bucket],
    room: int,
    *,
    mode: str = "auto",
    resident_room: Optional[int] = None,
    host_memory: Optional[int] = None,
    in_flight: int = 2,
    speculate: bool = False,
    staging_slots: int = 2,
) -> ModelStatePlan:
    """Where each bucket lives and is updated, within ``room`` device bytes (what the activation plan leaves).

    ``mode``: "resident" (every bucket on the device, stepped there: today's behaviour), "offload" (every
    bucket streamed, stepped on the host: the conservative plan) or "auto": the buckets first in forward order
    are made resident (they are the last of the backward pass, whose host step could hide behind nothing)
    while ``resident_room`` (default: all of ``room``) allows; of the rest, as many as fit keep a device
    compute copy (``HOST_MASTER``: one weight fetch a step fewer than streaming), in forward order; the others
    are streamed. ``host_memory``: host bytes model state may take (None: no limit). ``speculate``: stage
    speculative host steps in ``staging_slots`` slots. Bytes are counted as Note [Model-state bytes] says.

    Raises ``ModelStateDoesNotFit`` when even the plan that needs least of the device (or of the host)
    exceeds ``room`` (or ``host_memory``), naming the smallest that fits.
    """
    if mode not in MODES:
        raise ValueError(f"unknown model_state mode {mode!r}: choose one of {', '.join(MODES)}")
    if room < 0:
        raise ValueError(f"room must not be negative, not {room}")
    if in_flight < 1:
        raise ValueError(f"in_flight must be at least 1 bucket, not {in_flight}")
    slots = staging_slots if speculate else 0
    n = len(buckets)
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
    device, host, pinned = plan_bytes(buckets, placements, in_flight, slots)
    if device > room:
        raise ModelStateDoesNotFit("device", device, room, (
            f"every bucket resident needs {fmt_bytes(device)} of the device, and the activation plan leaves "
            f"{fmt_bytes(room)}: use model_state='auto' or 'offload' (the host keeps what does not fit), or raise "
            f"the budget by {fmt_bytes(device - room)}"))  # fmt: skip
    if host_memory is not None and host > host_memory:
        _refuse_host(buckets, placements, host, host_memory)
    sites = [UpdateSite.DEVICE if p == Placement.RESIDENT else UpdateSite.HOST for p in placements]
    plan = ModelStatePlan(placements, sites, speculate and any(s == UpdateSite.HOST for s in sites),
                          slots, device, host, pinned)  # fmt: skip
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
    while k < n:
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
