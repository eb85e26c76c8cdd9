"""The variable sequence of a trace and the trace under swapping now live in the library
(``swap.planning.from_trace``: ``swap.plan`` needs them); this name stays for the benchmarks' and tests' imports."""

from swap.planning.from_trace import Cost, plan_for, sequence_from_trace, swapped  # noqa: F401 - re-exported
