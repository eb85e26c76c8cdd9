"""Parameters packed into buckets, one packer for the forecast (parameters of a model built on the meta device) and
the runtime (the storages of the user's parameters), and the size of a bucket when the user names none, from the
budget and the model (the same function on both sides).

Note [One packer]
``pack`` takes sizes in first-use order (what it is not given goes last, in index order) and fills each bucket
greedily: an item that would take the bucket past ``bucket_bytes`` starts the next one. An item is never split,
so one larger than ``bucket_bytes`` is a bucket of its own. No bucket exceeds ``bucket_bytes`` unless one item
does: the runtime's budget rests on that bound (streaming reserves room for the largest buckets in flight, and
tight budgets were measured against it). The forecast once let a bucket under a quarter full take the next item
past the size (so a norm's few kilobytes would not make a bucket alone); that rule made buckets the runtime does
not, and a few kilobytes alone cost only a copy's fixed cost, so the one rule is the greedy one. The forecast
packs parameters (``pack_buckets``, shared ones once); the runtime packs storages (several parameters on one
storage move together), so the two agree wherever every parameter has a storage of its own.

Note [Bucket size by default]
A bucket is what one use of weights holds on the device: streaming holds the bucket in use, the one fetched ahead
and, in the backward pass, their gradients on their way to the host. So the smallest budget a model can stream
under grows with the bucket, and one size cannot fit every model: 32 MiB puts a 2.6 MB model in one bucket
(streaming it then means holding all of it), while a 1 B-parameter model in 64 KiB buckets would pay a copy's
fixed cost thousands of times a step. The default is the weights over ``PER_MODEL`` buckets, and at most
``1 / PER_BUDGET`` of the budget (so the few buckets streaming holds at once stay a small part of it), between
``SMALLEST`` and ``LARGEST``; ``bucket_bytes=`` overrides it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple, Optional

from .plan import Bucket

PER_MODEL = 16  # buckets a model is split into at least (when that stays above SMALLEST)
PER_BUDGET = 32  # a bucket is at most this fraction of the budget
SMALLEST = 64 << 10
LARGEST = 32 << 20


def default_bucket_bytes(weight_bytes: int, budget: Optional[int]) -> int:
    """Note [Bucket size by default]: the bucket size for ``weight_bytes`` of managed weights under ``budget``
    (None: no budget known, the weights alone decide)."""
    size = weight_bytes // PER_MODEL
    if budget is not None:
        size = min(size, budget // PER_BUDGET)
    return max(SMALLEST, min(LARGEST, size))


class ParamInfo(NamedTuple):
    """One parameter as the packer sees it (bytes per role, as in ``Bucket``)."""

    name: str
    numel: int
    weight_bytes: int
    master_bytes: int
    grad_bytes: int
    state_bytes: int


def pack(sizes: Sequence[int], bucket_bytes: int, order: Optional[Iterable[int]] = None) -> list[list[int]]:
    """Items (indices into ``sizes``) in ``order`` (default: index order; first occurrences count, the items it
    omits go last in index order) packed into buckets of about ``bucket_bytes`` (Note [One packer]). Pure."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, not {bucket_bytes}")
    ordered = list(dict.fromkeys(range(len(sizes)) if order is None else order))
    placed = set(ordered)
    ordered += [i for i in range(len(sizes)) if i not in placed]
    buckets: list[list[int]] = []
    room = 0
    for i in ordered:
        if not buckets or sizes[i] > room:
            buckets.append([])
            room = bucket_bytes
        buckets[-1].append(i)
        room -= sizes[i]
    return buckets


def pack_buckets(params: Sequence[ParamInfo], bucket_bytes: Optional[int] = None,
                 budget: Optional[int] = None) -> list[Bucket]:  # fmt: skip
    """Packs ``params`` (already in first-use order, shared ones once, unread ones last) into buckets of
    about ``bucket_bytes`` of weights (``pack``, Note [One packer]); None: ``default_bucket_bytes`` of the weights
    and ``budget``, as the runtime sizes them."""
    if bucket_bytes is None:
        bucket_bytes = default_bucket_bytes(sum(p.weight_bytes for p in params), budget)
    roles = ("weight_bytes", "master_bytes", "grad_bytes", "state_bytes")
    out = []
    for k, members in enumerate(pack([p.weight_bytes for p in params], bucket_bytes)):
        group = [params[i] for i in members]
        out.append(Bucket(k, tuple(p.name for p in group), sum(p.numel for p in group),
                          *(sum(getattr(p, f) for p in group) for f in roles)))  # fmt: skip
    return out
