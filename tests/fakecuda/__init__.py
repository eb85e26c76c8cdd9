"""fakecuda: an emulated CUDA driver (``libcuda.so.1`` on host memory) for testing vmalloc's cuda backend
without a GPU. See README.md. ``driver()`` loads it (building it with ``make fakecuda`` if needed)."""

from .api import CudaError, FakeCuda, driver
from .build import ensure_built, library_path

__all__ = ["CudaError", "FakeCuda", "driver", "ensure_built", "library_path"]
