"""The size of a bucket of parameters when the user names none, from the budget and the model.

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

from typing import Optional

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
