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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


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
