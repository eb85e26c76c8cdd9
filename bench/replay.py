"""Trace replay against allocators now lives in the library (``swap.replay``: ``swap.plan`` needs it); this
name stays for the benchmarks' and tests' imports."""

from swap.replay.replay import ALLOCATORS, make_allocator, measure, replay  # noqa: F401 - re-exported
