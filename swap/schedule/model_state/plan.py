"""Model state in the plan: parameters packed into buckets, and where each bucket's weights, gradients,
optimizer state and update live. Pure data shared by the runtime (which applies a plan) and the forecast (which
prices one); ``placing.plan_model_state`` chooses a plan under a budget, ``choice.choose_model_state`` the fastest
by simulation.

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

Note [One vocabulary for model state]
Where model state lives is said with these words only, by the user and inside: a bucket is ``RESIDENT``,
``HOST_MASTER`` or ``STREAMED`` (``Placement``); a policy (``ModelStatePolicy.placement``, ``swap.plan``'s
``model_state``, the FSDP2 path) asks for ``"auto"`` (chosen per bucket under the budget) or one placement for
every bucket (``PLACEMENTS``). An FSDP2 unit is a bucket (its shard offloaded: ``STREAMED``). The older
spelling ``"offload"`` (every bucket streamed) is ``"streamed"`` (``OLD_SPELLINGS``: read with a FutureWarning
by ``placement_named``).
"""

from __future__ import annotations

import warnings
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
        mixed: trained in mixed precision (Note [Mixed precision] in swap.runtime.model_state.precision): the
            weights are a compute-dtype copy of the master, the gradients (``grad_bytes``) cross the link in the
            compute dtype and are upcast into host buffers in the master's dtype (``host_grad_bytes``), and the
            bucket is never ``RESIDENT`` (only the host keeps an fp32 master apart from the compute copy).
    """

    index: int
    params: tuple[str, ...]
    numel: int
    weight_bytes: int
    master_bytes: int
    grad_bytes: int
    state_bytes: int
    mixed: bool = False

    @property
    def host_grad_bytes(self) -> int:
        """Bytes of the bucket's host gradient buffers: ``grad_bytes`` in the master's dtype when ``mixed`` (the
        upcast gradients), else ``grad_bytes``."""
        if not self.mixed or not self.weight_bytes:
            return self.grad_bytes
        return self.grad_bytes * self.master_bytes // self.weight_bytes

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
        staging_slots: buckets the speculative host steps may hold staged at once (0 without speculation): the
            first offloaded buckets the backward finishes (``speculated``).
        device_bytes: the most device bytes model state takes under this plan (resident buckets, buckets in
            flight, gradients not yet copied out).
        host_bytes: host bytes model state takes (masters, gradient buffers, optimizer state, staging).
        pinned_bytes: the part of ``host_bytes`` that is page-locked.
        notes: why the plan is what it is, for the report.
        room: the device bytes the plan was made within (``plan_model_state``'s ``room``; 0: not said).
    """

    placements: list[Placement]
    update_sites: list[UpdateSite]
    speculate: bool = False
    staging_slots: int = 0
    device_bytes: int = 0
    host_bytes: int = 0
    pinned_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    room: int = 0

    def __post_init__(self) -> None:
        if len(self.placements) != len(self.update_sites):
            raise ValueError(f"{len(self.placements)} placements but {len(self.update_sites)} update sites: "
                             "give one of each per bucket")  # fmt: skip
        for i, (p, u) in enumerate(zip(self.placements, self.update_sites)):
            if u == UpdateSite.DEVICE and p != Placement.RESIDENT:
                raise ValueError(f"bucket {i} is {p.value} but updated on the device: only resident buckets are")

    def speculated(self) -> list[int]:
        """The buckets whose host steps may start in the backward, before ``opt.step()``: the first
        ``staging_slots`` offloaded ones in backward order (the last in forward order first)."""
        if not self.speculate:
            return []
        offloaded = [i for i in range(len(self.placements) - 1, -1, -1) if self.update_sites[i] == UpdateSite.HOST]
        return offloaded[: self.staging_slots]

    @classmethod
    def uniform(cls, n: int, placement: Placement) -> ModelStatePlan:
        """Every one of ``n`` buckets placed alike (``RESIDENT``: updated on the device; else on the host)."""
        site = UpdateSite.DEVICE if placement == Placement.RESIDENT else UpdateSite.HOST
        return cls([placement] * n, [site] * n)


PLACEMENTS = ("auto", "resident", "host_master", "streamed")  # Note [One vocabulary for model state]
OLD_SPELLINGS = {"offload": "streamed"}


def placement_named(name: object, where: str = "model_state", stacklevel: int = 3) -> str:
    """``name`` in the one vocabulary (Note [One vocabulary for model state]): one of ``PLACEMENTS``, or an old
    spelling read with a FutureWarning naming the new one. Raises ``ValueError`` for anything else, saying
    what to pass. ``where``: the argument's name, for the messages."""
    if isinstance(name, str) and name in OLD_SPELLINGS:
        new = OLD_SPELLINGS[name]
        warnings.warn(f"{where}={name!r} is now spelled {new!r} (Note [One vocabulary for model state]): pass "
                      f"{new!r}; the old spelling will stop working", FutureWarning, stacklevel=stacklevel)  # fmt: skip
        return new
    if name not in PLACEMENTS:
        raise ValueError(f"unknown {where} {name!r}: choose one of {', '.join(map(repr, PLACEMENTS))}")
    return str(name)
