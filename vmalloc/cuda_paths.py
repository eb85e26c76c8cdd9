"""Where the CUDA headers are: for building the core (cuda.h) and the torch adapter (cuda_runtime_api.h).

Pure standard library, so setup.py loads it by path before anything is built.

Note [Finding the CUDA headers]
In order: ``CUDA_HOME`` / ``CUDA_PATH``, ``/usr/local/cuda``, then the headers that NVIDIA's pip wheels ship
in site-packages: CUDA 13 wheels put every header under ``nvidia/cu13/include`` (cuda-toolkit /
nvidia-cuda-runtime 13.x); CUDA 12 wheels put them per component (``nvidia/cuda_runtime/include``, which
holds cuda.h and cuda_runtime_api.h). A torch cu130 wheel installs the CUDA 13 layout, a cu12x one the other.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

# Relative to a site-packages directory, newest layout first.
WHEEL_LAYOUTS = ("nvidia/cu13/include", "nvidia/cuda_runtime/include", "nvidia/cu12/include")


def site_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def candidate_dirs(env: Optional[dict] = None, sites: Optional[Iterable[str]] = None) -> list[Path]:
    """Every directory that may hold the CUDA headers, in the order they are tried."""
    env = os.environ if env is None else env
    out = [Path(env[k]) / "include" for k in ("CUDA_HOME", "CUDA_PATH") if env.get(k)]
    out.append(Path("/usr/local/cuda/include"))
    for site in site_dirs() if sites is None else sites:
        out += [Path(site) / layout for layout in WHEEL_LAYOUTS]
    return out


def find_header(name: str, env: Optional[dict] = None, sites: Optional[Iterable[str]] = None) -> Optional[Path]:
    """The first candidate directory holding ``name`` (e.g. "cuda.h"), or None."""
    for d in candidate_dirs(env, sites):
        if (d / name).is_file():
            return d
    return None
