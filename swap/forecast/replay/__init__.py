"""Allocation traces replayed against allocators: vmalloc's real core (sim backend) and models of PyTorch's
caching allocator policies; used by ``swap.plan`` to tell whether a run fits a device with that allocator."""

from __future__ import annotations

from .replay import ALLOCATORS, BUDGET_FRACTIONS, CHUNK_SIZE, fitting_budget, make_allocator, measure, replay
from .torch_policy import ExpandableSegmentsModel, NativeCachingModel

__all__ = [
    "ALLOCATORS", "BUDGET_FRACTIONS", "CHUNK_SIZE", "ExpandableSegmentsModel", "NativeCachingModel", "fitting_budget",
    "make_allocator", "measure", "replay",
]  # fmt: skip
