"""Builds vmalloc's C++ core with CMake (see CMakeLists.txt; what the build needs: Note [What installs build
and what they need] in pyproject.toml).

Environment:
  VMALLOC_SANITIZE=1       build with ASan + UBSan
  VMALLOC_BUILD_DIR=DIR    CMake build directory (default: build/cmake-<python tag> for in-place and editable
                           builds, where bench/alloc_latency.py finds its executable; the build's temporary
                           directory for a wheel)
  CUDA_HOME                where to look for cuda.h first (then /usr/local/cuda, then the nvidia/cu13 or
                           nvidia/cuda_runtime pip wheels' headers)

The torch adapter (csrc/torch/adapter.cpp) is not built here: it must match the torch that runs it, so
vmalloc.torch_adapter builds it on first use against the installed torch (see Note [Building the adapter]).
Its sources are copied into the package so a wheel install can build it too.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def cmake_command() -> str:
    """cmake on PATH (pip's isolated build puts the declared cmake there), else the cmake package's own."""
    found = shutil.which("cmake")
    if found:
        return found
    try:
        import cmake
    except ImportError:
        sys.exit("vmalloc: cmake is needed to build the core: pip install cmake (or your system's package)")
    return str(Path(cmake.CMAKE_BIN_DIR) / "cmake")


def cuda_include_dir() -> str:
    """The directory holding cuda.h (see Note [Finding the CUDA headers] in vmalloc/cuda_paths.py)."""
    spec = importlib.util.spec_from_file_location("vmalloc_cuda_paths", ROOT / "vmalloc" / "cuda_paths.py")
    cuda_paths = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cuda_paths)
    found = cuda_paths.find_header("cuda.h")
    return str(found) if found else ""


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(os.environ.get("VMALLOC_BUILD_DIR", self._default_build_dir()))
        build_dir.mkdir(parents=True, exist_ok=True)
        import pybind11

        args = [
            f"-DVMALLOC_OUTPUT_DIR={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DVMALLOC_CUDA_INCLUDE_DIR={cuda_include_dir()}",
            f"-DVMALLOC_SANITIZE={'ON' if os.environ.get('VMALLOC_SANITIZE') == '1' else 'OFF'}",
        ]
        cmake = cmake_command()
        subprocess.run([cmake, "-S", str(ROOT), "-B", str(build_dir), *args], check=True)
        jobs = str(os.cpu_count() or 2)
        subprocess.run([cmake, "--build", str(build_dir), "-j", jobs], check=True)
        adapter_src = out_dir / "torch_adapter_src"
        adapter_src.mkdir(exist_ok=True)
        for f in (ROOT / "csrc" / "torch").iterdir():
            shutil.copy2(f, adapter_src / f.name)
        if getattr(self, "editable_mode", False):
            self._copy_core_library(out_dir)

    def _default_build_dir(self) -> Path:
        if self.inplace or getattr(self, "editable_mode", False):
            return ROOT / "build" / f"cmake-{sys.implementation.cache_tag}"
        return Path(self.build_temp).resolve() / "cmake"

    def copy_extensions_to_source(self) -> None:
        # `build_ext --inplace` builds under build/ and then copies _C into the source tree; the core library
        # goes too (_C finds it through RUNPATH $ORIGIN first, so a stale copy there would be loaded).
        super().copy_extensions_to_source()
        self._copy_core_library(Path(self.build_lib) / "vmalloc")

    @staticmethod
    def _copy_core_library(out_dir: Path) -> None:
        """setuptools copies _C into the source tree (editable install, --inplace); its core library goes too."""
        shutil.copy2(out_dir / "libvmalloc.so", ROOT / "vmalloc" / "libvmalloc.so")


setup(ext_modules=[CMakeExtension("vmalloc._C")], cmdclass={"build_ext": CMakeBuild})
