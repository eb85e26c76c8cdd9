"""Trace replay against allocators now lives in the library (``swap.planning.replay``: ``swap.plan`` needs it); this
name stays for the benchmarks' and tests' imports."""

from swap.planning.replay.replay import ALLOCATORS, make_allocator, measure, replay  # noqa: F401 - re-exported
