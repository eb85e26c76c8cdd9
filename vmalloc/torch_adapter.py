"""Builds and loads vmalloc's torch adapter (csrc/torch/adapter.cpp), a torch C++ extension.

Note [Building the adapter]
The adapter subclasses torch's C++ ``CUDAPluggableAllocator``, so its vtable must match the torch that loads
it exactly: a copy built for another torch release would call the wrong virtual methods. It is therefore
built on first use (``vmalloc.allocator()``), against the installed torch, with
``torch.utils.cpp_extension.load`` (once), and cached per torch version and source hash under
``$VMALLOC_CACHE`` (default ``~/.cache/vmalloc``): upgrading torch builds a new one. Building it when the
package is built instead would tie the wheel to the torch present then: with pip's build isolation, a torch
pip downloads into the build environment (gigabytes, and not necessarily the user's build), and a CPU-only
user, who never needs the adapter, would pay for it too. ``python -m vmalloc.torch_adapter`` builds it ahead
of time (``make gpu`` does).

What the build needs, and where it comes from: ninja (torch runs it) is a dependency of the package, found on
PATH or, when the environment is not activated, in the ninja package (``ninja_dir()``); the CUDA runtime's
headers come with a CUDA build of torch (its nvidia wheels) or a CUDA toolkit (Note [Finding the CUDA
headers] in vmalloc/cuda_paths.py); the one thing pip cannot bring is a C++ compiler (``$CXX``, else c++).

When the adapter cannot be built or loaded (no CUDA in this torch, no compiler, missing CUDA headers,
``VMALLOC_TORCH_ADAPTER=0``), ``load()`` returns None and ``reason()`` says why and what to do;
``vmalloc.allocator()`` then refuses unless the fallback is asked for (Note [No silent fallback] in
vmalloc/torch_allocator.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

from . import cuda_paths

log = logging.getLogger("vmalloc")

_PACKAGE = Path(__file__).resolve().parent
_SOURCE_FILES = ("adapter.cpp", "core_api.h")
_loaded: Optional[ModuleType] = None
_reason: Optional[str] = None
_tried = False


def source_dir() -> Optional[Path]:
    """The adapter's sources: the repository's csrc/torch, else the copy installed with the package."""
    for d in (_PACKAGE.parent / "csrc" / "torch", _PACKAGE / "torch_adapter_src"):
        if all((d / f).is_file() for f in _SOURCE_FILES):
            return d
    return None


def extension_name(torch_version: str) -> str:
    """A module name per torch version (``vmalloc_torch_2_11_0_cu130``): one cached build per torch."""
    return "vmalloc_torch_" + re.sub(r"[^0-9A-Za-z]+", "_", torch_version).strip("_")


def cache_dir(name: str, sources: Path) -> Path:
    digest = hashlib.sha256()
    for f in _SOURCE_FILES:
        digest.update((sources / f).read_bytes())
    root = Path(os.environ.get("VMALLOC_CACHE", Path.home() / ".cache" / "vmalloc"))
    return root / "torch_adapter" / f"{name}-py{sys.version_info[0]}{sys.version_info[1]}-{digest.hexdigest()[:12]}"


def build_arguments(torch_module: Any, library_path: str, sources: Path) -> dict[str, Any]:
    """The keyword arguments for ``torch.utils.cpp_extension.load`` (pure: tests check them without building).

    Raises RuntimeError naming what is missing."""
    cuda_runtime = cuda_paths.find_header("cuda_runtime_api.h")
    if cuda_runtime is None:
        raise RuntimeError(
            "cuda_runtime_api.h not found (looked in CUDA_HOME, /usr/local/cuda and the nvidia/cu13 and "
            "nvidia/cuda_runtime wheels): install the CUDA toolkit or set CUDA_HOME"
        )
    torch_lib = Path(torch_module.__file__).resolve().parent / "lib"
    lib_dir = str(Path(library_path).resolve().parent)
    name = extension_name(torch_module.__version__)
    # The CUDA runtime torch itself loaded (cacheInfo asks it for the device's free memory): linking that very
    # file means no second copy of the runtime is loaded.
    cudart = loaded_library("libcudart.so")
    cudart_flags = [cudart, f"-Wl,-rpath,{Path(cudart).parent}"] if cudart else []
    return {
        "name": name,
        "sources": [str(sources / "adapter.cpp")],
        "extra_include_paths": [str(sources), str(cuda_runtime)],
        "extra_cflags": ["-O2"],
        # libvmalloc.so (the core: the same global arenas vmalloc._C uses) and torch's CUDA libraries.
        "extra_ldflags": [
            f"-L{lib_dir}", "-lvmalloc", f"-Wl,-rpath,{lib_dir}",
            f"-L{torch_lib}", "-lc10_cuda", "-ltorch_cuda", f"-Wl,-rpath,{torch_lib}", *cudart_flags,
        ],  # fmt: skip
        "build_directory": str(cache_dir(name, sources)),
        "with_cuda": False,
        "verbose": os.environ.get("VMALLOC_VERBOSE_BUILD") == "1",
    }


def loaded_library(prefix: str, maps: str = "/proc/self/maps") -> Optional[str]:
    """The path of a shared library this process has loaded whose file name starts with ``prefix``."""
    try:
        with open(maps) as f:
            for line in f:
                path = line.split(maxsplit=5)[-1].strip() if line.count(" ") >= 5 else ""
                if path.startswith("/") and Path(path).name.startswith(prefix):
                    return path
    except OSError:
        pass
    return None


def ninja_dir() -> Optional[str]:
    """The directory of the ninja that torch's build runs: PATH's, else the ninja package's (a dependency, whose
    executable sits in the environment's bin/, on PATH only when the environment is activated); None if none."""
    found = shutil.which("ninja")
    if found:
        return str(Path(found).parent)
    try:
        import ninja
    except ImportError:
        return None
    bin_dir = Path(ninja.BIN_DIR)
    return str(bin_dir) if (bin_dir / "ninja").is_file() else None


@contextlib.contextmanager
def _ninja_on_path(directory: str) -> Iterator[None]:
    """PATH with ``directory`` in front while torch builds (it runs plain ``ninja``)."""
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = directory + os.pathsep + old if old else directory
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _why_not(torch_module: Any) -> Optional[str]:
    if os.environ.get("VMALLOC_TORCH_ADAPTER", "1") == "0":
        return "VMALLOC_TORCH_ADAPTER=0 turns it off: unset it to use the adapter"
    if not getattr(torch_module.version, "cuda", None):
        return f"this torch ({torch_module.__version__}) is not a CUDA build"
    if not hasattr(torch_module._C, "_cuda_changeCurrentAllocator"):
        return f"this torch ({torch_module.__version__}) has no pluggable CUDA allocators: use torch >= 2.4"
    if source_dir() is None:
        return ("the adapter's sources (csrc/torch/adapter.cpp) are not installed with this vmalloc: reinstall "
                "vmalloc-swap from its wheel or sdist")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}; $CXX names another) to build it: install one (g++ or clang++)"
    if ninja_dir() is None:
        return "ninja, which torch builds it with, is not installed: pip install ninja (a dependency of vmalloc-swap)"
    return None


def load() -> Optional[ModuleType]:
    """The adapter module (built on first call, then cached), or None; ``reason()`` says why not."""
    global _loaded, _reason, _tried
    if _tried:
        return _loaded
    _tried = True
    import torch

    from . import _C

    _reason = _why_not(torch)
    if _reason is not None:
        return None
    try:
        from torch.utils import cpp_extension

        args = build_arguments(torch, _C.library_path(), source_dir())
        Path(args["build_directory"]).mkdir(parents=True, exist_ok=True)
        log.info("vmalloc: loading the torch adapter for torch %s (built once into %s)", torch.__version__,
                 args["build_directory"])  # fmt: skip
        with _ninja_on_path(ninja_dir()):
            module = cpp_extension.load(**args)
    except Exception as e:  # noqa: BLE001 - any build or load failure means: no adapter, say why
        _reason = (f"building or loading it failed: {type(e).__name__}: {str(e).strip()[-1500:]} "
                   "(VMALLOC_VERBOSE_BUILD=1 python -m vmalloc.torch_adapter retries the build, showing the compiler's "
                   "output)")  # fmt: skip
        return None
    expected = torch.__version__.split("+")[0]
    if module.torch_version != expected:
        _reason = f"it was built for torch {module.torch_version}, but torch {expected} is running"
        return None
    _loaded = module
    return module


def reason() -> Optional[str]:
    """Why the adapter is not in use (None when it is, or before ``load()``)."""
    return _reason


def main() -> int:
    module = load()
    if module is None:
        print(f"vmalloc torch adapter: not available: {reason()}")
        return 1
    print(f"vmalloc torch adapter: ready for torch {module.torch_version} ({module.__file__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
