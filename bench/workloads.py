"""The allocation workloads now live in the library (``swap.planning.replay.workloads``: the allocator demo in examples/
uses them, and nothing outside bench/ and tests/ may import bench); this name stays for the tests' imports."""

from swap.planning.replay.workloads import fragmentation_workload, mixed_sizes  # noqa: F401 - re-exported
