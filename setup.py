"""Builds vmalloc's C++ core with CMake (see CMakeLists.txt).

Environment:
  VMALLOC_SANITIZE=1       build with ASan + UBSan
  VMALLOC_BUILD_DIR=DIR    CMake build directory (default: build/cmake-<python tag>)
  CUDA_HOME                where to look for cuda.h first
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def cuda_include_dir() -> str:
    """cuda.h from the toolkit, else from the nvidia-cuda-runtime-cu12 wheel's headers."""
    for base in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if base and (Path(base) / "include" / "cuda.h").exists():
            return str(Path(base) / "include")
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        candidate = Path(site) / "nvidia" / "cuda_runtime" / "include"
        if (candidate / "cuda.h").exists():
            return str(candidate)
    return ""


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        tag = f"{sys.implementation.cache_tag}"
        build_dir = Path(os.environ.get("VMALLOC_BUILD_DIR", ROOT / "build" / f"cmake-{tag}"))
        build_dir.mkdir(parents=True, exist_ok=True)
        import pybind11

        args = [
            f"-DVMALLOC_OUTPUT_DIR={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DVMALLOC_CUDA_INCLUDE_DIR={cuda_include_dir()}",
            f"-DVMALLOC_SANITIZE={'ON' if os.environ.get('VMALLOC_SANITIZE') == '1' else 'OFF'}",
        ]
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build_dir), *args], check=True)
        jobs = str(os.cpu_count() or 2)
        subprocess.run(["cmake", "--build", str(build_dir), "-j", jobs], check=True)
        if getattr(self, "editable_mode", False):
            # setuptools copies _C into the source tree for an editable install; its core library goes too.
            shutil.copy2(out_dir / "libvmalloc.so", ROOT / "vmalloc" / "libvmalloc.so")


setup(ext_modules=[CMakeExtension("vmalloc._C")], cmdclass={"build_ext": CMakeBuild})
