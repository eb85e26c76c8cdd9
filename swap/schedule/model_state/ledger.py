"""The bytes of model state, one ledger for the forecast and the runtime: optimizer state by optimizer, what each
placement holds on the device and the host (and how much of the host's is pinned), and the host memory a run
takes, predicted before any of it is allocated.

Note [Model-state bytes]
What each placement holds, per bucket, on the device between steps and on the host (``device_bytes_of``,
``host_bytes_of``):

- ``RESIDENT``: device weights, gradients and state, and the master if it is a separate tensor (its bytes
  differ from the weights': fp32 masters of bf16 weights); nothing on the host.
- ``HOST_MASTER``: the device compute copy; on the host the master, a gradient buffer and the state, plus a
  copy in the compute dtype when the master has another dtype (what the update's H2D copy reads).
- ``STREAMED``: nothing on the device between uses; on the host as ``HOST_MASTER``.

A bucket in mixed precision (``Bucket.mixed``; Note [Mixed precision] in swap.runtime.model_state.precision) is
never ``RESIDENT``; on the host its gradient buffers are in the master's dtype (``host_grad_bytes``: the gradients
arrive in the compute dtype and are upcast there), and only its compute copy is pinned (the masters, gradient
buffers and state are pageable), as ``HostPrediction`` counts the runtime's.

Besides, while buckets move: streamed weights in flight (the one in use and the one arriving: ``in_flight``
of the largest streamed bucket), and gradients of offloaded buckets not yet copied out (``in_flight`` of the
largest). Speculative host steps keep rollback copies of the buckets they step (Note [Rollback copies]), one
slot each: the first ``staging_slots`` offloaded buckets whose gradients the backward makes (``speculated``: the
last in forward order first; the runtime speculates every offloaded bucket, so the forecast gives each a slot:
``choice.with_speculation``). Pinned are the bytes a copy engine reads or writes: gradient buffers and the H2D
source (the compute copy, or the master when there is none); not the rollback copies (no copy engine reads them).

Note [Rollback copies]
A speculative host step (Note [Speculative host steps] in swap/runtime/model_state/speculation.py) first copies
what it will write, so that a step ``opt.step()`` does not confirm can be undone exactly: the master and its
optimizer state once stepped, of every trainable parameter it steps (``rollback_bytes``). Every offloaded bucket
may be speculated before ``opt.step()`` confirms any, so the most they hold at once is the sum over every
trainable offloaded parameter. They are ordinary pageable tensors (not the host pool's: unaligned, unpinned).
The runtime speculates only where they fit the host memory beside the rest of the model state (``speculates``,
Note [When to speculate]); the forecast decides with the same function on the same bytes, and counts them in its
host bytes where it speculates.
Note [Optimizer state by optimizer]
How many tensors of a parameter's size an optimizer keeps is one table, ``STATE_TENSORS``, read by the forecast
(``StateFormat``, the FSDP2 lanes, the host profiles' DRAM passes) and the runtime (which maps the user's torch
optimizer onto it: ``swap.runtime.model_state.buckets.optimizer_kind``). Adam and AdamW keep two moments (three
with ``amsgrad``) and a step counter (a scalar tensor each parameter: ``step_bytes``); SGD keeps a momentum buffer
when momentum is on (``"sgd"``) and nothing without (``"sgd_plain"``). An optimizer the table does not know is
counted as two moments, the common case.

Note [Host memory before allocating]
Offloaded model state lives in host memory: the master weights and the gradient buffers (page-locked, exact
sizes rounded to the host pool's alignment), the optimizer state (pageable: it never crosses the link), and the
accumulation buffer (pinned, a bucket's worth, or the largest gradient as it arrives: where gradients of an
accumulating backward are summed before they join their buffer). Under mixed precision (Note [Mixed precision] in
swap.runtime.model_state.precision) the masters, gradients and state are fp32 and pageable, and a pinned copy of
each master in the compute dtype is what the link reads; every gradient arrives through the accumulation buffer
to be upcast. All of it is known from the parameters and the optimizer
before the first byte is taken (``predict_host``), so the runtime compares the sum with the host memory it may use
and refuses with the figures (``refuse_host_over``: the largest model that fits, the smallest host that holds this
one) instead of letting the kernel's OOM killer end the run halfway; the forecast counts the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

from ...units import fmt_bytes
from .plan import Bucket, Placement

STATE_TENSORS = {"adamw": 2, "adam": 2, "sgd": 1, "sgd_plain": 0}  # Note [Optimizer state by optimizer]
UNKNOWN_STATE_TENSORS = 2


def state_tensors(optimizer: str, amsgrad: bool = False) -> int:
    """Tensors of a parameter's size ``optimizer`` keeps (Note [Optimizer state by optimizer]); an optimizer the
    table does not know: ``UNKNOWN_STATE_TENSORS``."""
    n = STATE_TENSORS.get(optimizer, UNKNOWN_STATE_TENSORS)
    return n + 1 if amsgrad and optimizer in ("adam", "adamw") else n


def state_bytes(optimizer: str, tensor_bytes: int, *, amsgrad: bool = False, step_bytes: int = 0) -> int:
    """Bytes of optimizer state of one parameter whose state tensors take ``tensor_bytes`` each, once stepped
    (Note [Optimizer state by optimizer]); ``step_bytes``: its step counter, where it has one (Adam's)."""
    n = state_tensors(optimizer, amsgrad)
    return n * tensor_bytes + (step_bytes if optimizer in ("adam", "adamw") else 0)


class ModelStateDoesNotFit(ValueError):
    """No placement of the buckets fits: ``needed`` bytes of ``what`` ("device" or "host") against
    ``available``; the message says what would fit."""

    def __init__(self, what: str, needed: int, available: int, message: str) -> None:
        self.what, self.needed, self.available = what, needed, available
        super().__init__(message)


class HostMemoryError(ModelStateDoesNotFit, MemoryError):
    """Offloaded model state would not fit in host memory (Note [Host memory before allocating]): the host case
    of ``ModelStateDoesNotFit``, raised by the runtime before it allocates."""

    def __init__(self, needed: int, available: int, message: str) -> None:
        super().__init__("host", needed, available, message)


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
    host = b.master_bytes + b.host_grad_bytes + b.state_bytes + copy
    if b.mixed:  # only what the link reads is pinned: the compute copy (the accumulation buffer apart)
        return host, copy
    return host, b.grad_bytes + (copy or b.master_bytes)


def plan_bytes(buckets: Sequence[Bucket], placements: Sequence[Placement], in_flight: int = 2,
               staging_slots: int = 0, accumulation: int = 0) -> tuple[int, int, int]:  # fmt: skip
    """(device, host, pinned) bytes of model state under ``placements`` (Note [Model-state bytes]);
    ``accumulation``: the pinned gradient-accumulation buffer the runtime keeps while any bucket is offloaded
    (``accumulation_bytes``, Note [Host memory before allocating])."""
    device = host = pinned = 0
    streamed = offloaded = 0
    backward = [b for b, p in zip(reversed(buckets), reversed(placements)) if p != Placement.RESIDENT]
    staged = rollback_bytes((b.master_bytes, b.state_bytes) for b in backward[:staging_slots])  # in backward order
    for b, p in zip(buckets, placements):
        device += device_bytes_of(b, p)
        h, pin = host_bytes_of(b, p)
        host, pinned = host + h, pinned + pin
        if p == Placement.STREAMED:
            streamed = max(streamed, b.weight_bytes)
        if p != Placement.RESIDENT:
            offloaded = max(offloaded, b.grad_bytes)
    device += in_flight * (streamed + offloaded)
    extra = accumulation if any(p != Placement.RESIDENT for p in placements) else 0
    return device, host + staged + extra, pinned + extra


def rollback_bytes(saved: Iterable[tuple[int, int]]) -> int:
    """Host bytes the rollback copies of speculative host steps take at most (Note [Rollback copies]): of each
    (master bytes, optimizer-state bytes once stepped) in ``saved`` (one per trainable offloaded parameter, or per
    offloaded bucket: the sums are the same), both."""
    return sum(master + state for master, state in saved)


def speculates(model_state: int, rollback: int, limit: int) -> bool:
    """Whether host steps speculate (Note [When to speculate] in swap/runtime/model_state/speculation.py): the
    ``rollback`` copies (``rollback_bytes``) fit the host memory ``limit`` beside the ``model_state`` bytes
    (``HostPrediction.total``). One rule for the runtime and the forecast."""
    return model_state + rollback <= limit


@dataclass
class HostPrediction:
    """Host bytes model state will take (Note [Host memory before allocating]): masters, gradient buffers,
    optimizer state, the accumulation buffer and, under mixed precision, the masters' copies in the compute dtype.
    Pinned: what a copy reads or writes (``mixed``: the compute copies and the accumulation buffer; else masters,
    gradients and the accumulation buffer)."""

    masters: int
    grads: int
    state: int
    accumulation: int
    params: int  # parameters (elements) these bytes are for
    copies: int = 0
    mixed: bool = False
    rollback: int = 0  # Note [Rollback copies]: at most (not in ``total``: taken where they fit, ``speculates``)

    @property
    def pinned(self) -> int:
        if self.mixed:
            return self.copies + self.accumulation
        return self.masters + self.grads + self.accumulation

    @property
    def total(self) -> int:
        return self.masters + self.grads + self.state + self.accumulation + self.copies


def aligned(n: int, align: int) -> int:
    """``n`` bytes as a pool of ``align``-byte alignment hands them out (at least one unit)."""
    return max(align, -(-n // align) * align)


def accumulation_bytes(grads: Sequence[int], bucket_bytes: int, align: int = 1) -> int:
    """The gradient-accumulation buffer (Note [Host memory before allocating]): a bucket's worth, or the largest
    of ``grads`` (each rounded to ``align``)."""
    return aligned(max(max((aligned(g, align) for g in grads), default=0), bucket_bytes), align)


def predict_host(masters: Sequence[int], grads: Sequence[int], states: Sequence[int], bucket_bytes: int,
                 params: int, align: int = 1, arriving: Optional[Sequence[int]] = None,
                 copies: Sequence[int] = (), rollback: int = 0) -> HostPrediction:  # fmt: skip
    """What offloaded model state takes on the host (Note [Host memory before allocating]): ``masters``, one per
    host master (a storage), ``grads``, one per gradient buffer (a parameter that trains), ``states``, optimizer
    state per parameter, ``copies``, the compute-dtype copies of masters (mixed precision; none: not mixed), each
    block rounded to ``align``; the accumulation buffer is a bucket's worth or the largest gradient as it
    arrives (``arriving``, in the compute dtype; None: ``grads``); ``rollback``: the speculative host steps' copies,
    carried apart."""
    grad_sizes = [aligned(g, align) for g in grads]
    return HostPrediction(
        masters=sum(aligned(m, align) for m in masters), grads=sum(grad_sizes), state=sum(states),
        accumulation=accumulation_bytes(grads if arriving is None else arriving, bucket_bytes, align), params=params,
        copies=sum(aligned(c, align) for c in copies), mixed=bool(copies), rollback=rollback,
    )  # fmt: skip


def refuse_host_over(prediction: HostPrediction, limit: int, source: str) -> None:
    """Raises ``HostMemoryError`` when ``prediction`` exceeds ``limit`` bytes (``source`` says where the limit
    came from), with the largest model that fits and the smallest host that holds this one."""
    total = prediction.total
    if total <= limit:
        return
    per_param = total / max(prediction.params, 1)
    fits = int(limit / per_param) if per_param else 0
    copies = f", compute-dtype copies {fmt_bytes(prediction.copies)}" if prediction.copies else ""
    raise HostMemoryError(total, limit, (
        f"offloaded model state needs {fmt_bytes(total)} of host memory (master weights {fmt_bytes(prediction.masters)}"
        f", gradients {fmt_bytes(prediction.grads)}, optimizer state {fmt_bytes(prediction.state)}, accumulation "
        f"{fmt_bytes(prediction.accumulation)}{copies}), but {source} is {fmt_bytes(limit)}. The largest model that "
        f"fits is about {fits / 1e6:.1f} M parameters ({per_param:.1f} bytes each, this one has "
        f"{prediction.params / 1e6:.1f} M); this one needs a host with at least {fmt_bytes(total)} free (pass "
        "ModelStatePolicy(host_memory=...) if more is free than the kernel reports), or keep the model state on the "
        "device with ModelStatePolicy(placement='resident')"
    ))  # fmt: skip
