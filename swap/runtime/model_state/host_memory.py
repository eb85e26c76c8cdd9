"""Host memory for model state, predicted from the user's parameters before any of it is allocated (the ledger's
``predict_host``, in the host pool's units: Note [Host memory before allocating] in
swap.schedule.model_state.ledger), and refused when it would not fit (``HostMemoryError``).

The speculative host steps' copies (Note [Speculative host steps] in speculation) are predicted too, apart:
``rollback``, the masters and optimizer state of every trainable offloaded parameter, the most they hold at once
(Note [Rollback copies] in swap.schedule.model_state.ledger: ``rollback_bytes``, the forecast's count too). They
are taken only when they fit beside the rest (``speculates``); otherwise speculation is off (Note [When to
speculate]).
"""

from __future__ import annotations

import torch

from ...schedule.model_state.ledger import (
    HostMemoryError,
    HostPrediction,
    predict_host,
    refuse_host_over,
    rollback_bytes,
    speculates,
)
from ..machine.host_pool import ALIGN
from .buckets import Entry, group_of, stepped_state_bytes, trains
from .storage import grad_span

__all__ = ["HostMemoryError", "HostPrediction", "predict", "refuse_over", "speculates"]


def predict(entries: list[Entry], optimizer: torch.optim.Optimizer, bucket_bytes: int) -> HostPrediction:
    """What ``entries``' model state takes on the host, in the host pool's units (its 512-byte alignment): masters,
    gradient buffers and state in the masters' dtype; the accumulation buffer for gradients as they arrive (every
    one under mixed precision, where each is upcast), in the device copies' dtype; the compute-dtype copies, one
    per entry whose device copy has another dtype (Note [Mixed precision])."""
    groups = group_of(optimizer)
    params = [(p, e) for e in entries for _, p in e.params]
    # Note [Rollback copies]: what a speculation saves, a parameter at a time
    saved = [(p.numel() * e.master_dtype.itemsize, stepped_state_bytes(optimizer, p, groups, e.master_dtype))
             for p, e in params if trains(p) and id(p) in groups]  # fmt: skip
    return predict_host(
        [e.master_nbytes for e in entries],
        [grad_span(p, e.master_dtype) for p, e in params if trains(p)],  # Note [Frozen parameters]
        [stepped_state_bytes(optimizer, p, groups, e.master_dtype) for p, e in params],
        bucket_bytes, sum(p.numel() for p, _ in params), ALIGN,
        arriving=[grad_span(p, e.dtype) for p, e in params if trains(p)],
        copies=[e.nbytes for e in entries if e.dtype != e.master_dtype],
        rollback=rollback_bytes(saved),
    )  # fmt: skip


def refuse_over(prediction: HostPrediction, limit: int, source: str) -> None:
    """Raises ``HostMemoryError`` when ``prediction`` exceeds ``limit`` bytes (``source``: where the limit came
    from)."""
    refuse_host_over(prediction, limit, source)
