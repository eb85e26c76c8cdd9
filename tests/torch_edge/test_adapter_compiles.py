"""The torch adapter (csrc/torch/adapter.cpp) compiles against the installed torch's headers.

A syntax-only compile, so API drift in torch's CUDAPluggableAllocator / CUDAAllocator (an override whose
signature changed, a removed type) fails here on a machine without a GPU, before a GPU session finds it.
"""

import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from vmalloc import cuda_paths

ROOT = Path(__file__).resolve().parents[2]
TORCH_INCLUDE = Path(torch.__file__).resolve().parent / "include"


def cxx_standard() -> str:
    """The C++ standard torch.utils.cpp_extension compiles extensions with for this torch."""
    import inspect

    from torch.utils import cpp_extension

    found = set(re.findall(r"-std=c\+\+(\d\d)", inspect.getsource(cpp_extension)))
    return f"c++{max(found) if found else '17'}"


def test_adapter_compiles_against_the_installed_torch(tmp_path):
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    header = TORCH_INCLUDE / "torch" / "csrc" / "cuda" / "CUDAPluggableAllocator.h"
    if not header.is_file():
        pytest.skip(f"this torch ({torch.__version__}) ships no {header.relative_to(TORCH_INCLUDE)}")
    cuda_include = cuda_paths.find_header("cuda_runtime_api.h")
    if cuda_include is None:
        pytest.skip("no CUDA runtime headers (cuda_runtime_api.h) in CUDA_HOME, /usr/local/cuda or nvidia wheels")
    includes = [TORCH_INCLUDE, TORCH_INCLUDE / "torch" / "csrc" / "api" / "include", cuda_include]
    # CPU builds of torch ship c10/cuda's headers but not the one CMake generates for CUDA builds; it only
    # says c10_cuda is a shared library.
    if not (TORCH_INCLUDE / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").is_file():
        stub = tmp_path / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes.append(tmp_path)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [compiler, f"-std={cxx_standard()}", "-fsyntax-only", "-Wall", "-Wno-unused-parameter",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_EXTENSION_NAME=vmalloc_torch_adapter",
           "-I", str(ROOT / "csrc" / "torch"), "-isystem", sysconfig.get_paths()["include"]]  # fmt: skip
    for inc in includes:
        cmd += ["-isystem", str(inc)]
    cmd.append(str(ROOT / "csrc" / "torch" / "adapter.cpp"))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr[-6000:]}"
    assert "warning" not in r.stderr, r.stderr[-3000:]
