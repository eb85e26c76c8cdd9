"""Host memory for model state, predicted before any of it is allocated, and refused when it would not fit.

Note [Host memory before allocating]
Offloaded model state lives in host memory: the master weights and the gradient buffers (page-locked, from the
host pool, exact sizes: Note [Exact-size pinned blocks]), the optimizer state (pageable: it never crosses the
link), a staging buffer per gradient being accumulated, and under mixed precision (Note [Mixed precision] in
swap.runtime.model_state.precision) fp32 masters, gradients and state plus a pinned copy of each master in the
compute dtype (what the H2D copy reads; the fp32 buffers are then pageable), every gradient arriving through the
staging to be upcast. All of it is known from the parameters and the
optimizer before the first byte is taken, so the manager compares the sum with the host memory it may use
(``host_memory=``, else what the kernel reports available, MemAvailable) and refuses with the figures, the
largest model that fits and the smallest host that holds this one, instead of letting the kernel's OOM killer end
the run halfway.

The speculative host steps' copies (Note [Speculative host steps] in speculation) are predicted too, apart:
``rollback``, the masters and optimizer state of every trainable offloaded parameter, the most they hold at once
(every bucket speculated before ``opt.step()`` confirms any; unaligned: they are ordinary tensors). They are taken
only when they fit beside the rest; otherwise speculation is off (Note [When to speculate]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...units import fmt_bytes
from ..machine.host_pool import ALIGN
from .buckets import Entry, group_of, stepped_state_bytes, trains
from .storage import grad_span


class HostMemoryError(MemoryError):
    """Offloaded model state would not fit in host memory (Note [Host memory before allocating])."""


@dataclass
class HostPrediction:
    """Host bytes model state will take: masters, gradient buffers, optimizer state, staging for accumulated (or
    upcast) gradients, and the masters' copies in the compute dtype (Note [Mixed precision]; 0 without). Pinned:
    what a copy reads or writes (``mixed``: the compute copies and the staging; else masters, gradients and
    staging)."""

    masters: int
    grads: int
    state: int
    staging: int
    params: int  # parameters (elements) these bytes are for
    copies: int = 0
    mixed: bool = False
    rollback: int = 0  # the speculative host steps' copies at most (not in ``total``: taken only where they fit)

    @property
    def pinned(self) -> int:
        if self.mixed:
            return self.copies + self.staging
        return self.masters + self.grads + self.staging

    @property
    def total(self) -> int:
        return self.masters + self.grads + self.state + self.staging + self.copies


def _aligned(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


def predict(entries: list[Entry], optimizer: torch.optim.Optimizer, bucket_bytes: int) -> HostPrediction:
    """What ``entries``' model state takes on the host, in the host pool's units (its 512-byte alignment): masters,
    gradient buffers and state in the masters' dtype; the staging buffers for gradients accumulated (every one
    under mixed precision, where each is upcast) are a bucket's worth or the largest gradient, in the device
    copies' dtype; the compute-dtype copies, one per entry whose device copy has another dtype."""
    groups = group_of(optimizer)
    params = [(p, e) for e in entries for _, p in e.params]
    grad_sizes = [_aligned(grad_span(p, e.master_dtype)) for p, e in params if trains(p)]  # Note [Frozen parameters]
    arriving = [_aligned(grad_span(p, e.dtype)) for p, e in params if trains(p)]
    mixed = [e for e in entries if e.dtype != e.master_dtype]
    return HostPrediction(
        masters=sum(_aligned(e.master_nbytes) for e in entries),
        grads=sum(grad_sizes),
        state=sum(stepped_state_bytes(optimizer, p, groups, e.master_dtype) for p, e in params),
        staging=_aligned(max(max(arriving, default=0), bucket_bytes)),
        params=sum(p.numel() for p, _ in params),
        copies=sum(_aligned(e.nbytes) for e in mixed),
        mixed=bool(mixed),
        rollback=sum(p.numel() * e.master_dtype.itemsize + stepped_state_bytes(optimizer, p, groups, e.master_dtype)
                     for p, e in params if trains(p) and id(p) in groups),  # fmt: skip
    )


def refuse_over(prediction: HostPrediction, limit: int, source: str) -> None:
    """Raises ``HostMemoryError`` when ``prediction`` exceeds ``limit`` bytes (``source`` says where the limit
    came from)."""
    total = prediction.total
    if total <= limit:
        return
    per_param = total / max(prediction.params, 1)
    fits = int(limit / per_param) if per_param else 0
    copies = f", compute-dtype copies {fmt_bytes(prediction.copies)}" if prediction.copies else ""
    raise HostMemoryError(
        f"offloaded model state needs {fmt_bytes(total)} of host memory (master weights {fmt_bytes(prediction.masters)}"
        f", gradients {fmt_bytes(prediction.grads)}, optimizer state {fmt_bytes(prediction.state)}, staging "
        f"{fmt_bytes(prediction.staging)}{copies}), but {source} is {fmt_bytes(limit)}. The largest model that fits is "
        "about "
        f"{fits / 1e6:.1f} M parameters ({per_param:.1f} bytes each, this one has {prediction.params / 1e6:.1f} M); "
        f"this one needs a host with at least {fmt_bytes(total)} free (pass host_memory= if more is free than the "
        "kernel reports), or keep the model state on the device with model_state='resident'"
    )
