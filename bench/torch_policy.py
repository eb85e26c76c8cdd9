"""The models of PyTorch's allocator policies now live in the library (``swap.planning.replay.torch_policy``:
``swap.plan --allocator pytorch_native`` needs them); this name stays for the benchmarks' and tests' imports."""

from swap.planning.replay.torch_policy import (  # noqa: F401 - re-exported
    ExpandableSegmentsModel,
    NativeCachingModel,
    OutOfMemoryError,
    allocation_size,
    round_size,
)
