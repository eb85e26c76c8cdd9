"""Where the CUDA headers are: for building the core (cuda.h) and the torch adapter (cuda_runtime_api.h).

Pure standard library, so setup.py loads it by path before anything is built, and the Makefile runs it as a
script (``python vmalloc/cuda_paths.py cuda.h`` prints the directory: its CUDA_INCLUDE).

Note [Finding the CUDA headers]
In order: ``CUDA_HOME`` / ``CUDA_PATH``, ``/usr/local/cuda``, then the headers that NVIDIA's pip wheels ship
in site-packages: CUDA 13 wheels put every header under ``nvidia/cu13/include`` (cuda-toolkit /
nvidia-cuda-runtime 13.x); CUDA 12 wheels put them per component (``nvidia/cuda_runtime/include``, which
holds cuda.h and cuda_runtime_api.h). A torch cu130 wheel installs the CUDA 13 layout, a cu12x one the other.
The core needs only cuda.h's types (it asks the driver for each function's CUDA 12 ABI at run time), so any of
these builds it; ``pip install`` brings nvidia-cuda-runtime into its build environment for that
(pyproject.toml's build requirements), so a machine without a CUDA toolkit builds too.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

SYSTEM_INCLUDE = Path("/usr/local/cuda/include")  # the toolkit's default install, tried before the wheels
# Relative to a site-packages directory, newest layout first.
WHEEL_LAYOUTS = ("nvidia/cu13/include", "nvidia/cuda_runtime/include", "nvidia/cu12/include")


def site_dirs() -> list[str]:
    """This interpreter's site-packages, then every other one on sys.path: pip's isolated build environment
    adds the build requirements' directory there (the CUDA header wheel pyproject.toml declares), and
    sysconfig does not name it."""
    paths = sysconfig.get_paths()
    on_path = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    return list(dict.fromkeys([paths["purelib"], paths["platlib"], *on_path]))


def candidate_dirs(env: Optional[dict] = None, sites: Optional[Iterable[str]] = None) -> list[Path]:
    """Every directory that may hold the CUDA headers, in the order they are tried."""
    env = os.environ if env is None else env
    out = [Path(env[k]) / "include" for k in ("CUDA_HOME", "CUDA_PATH") if env.get(k)]
    out.append(SYSTEM_INCLUDE)
    for site in site_dirs() if sites is None else sites:
        out += [Path(site) / layout for layout in WHEEL_LAYOUTS]
    return out


def find_header(name: str, env: Optional[dict] = None, sites: Optional[Iterable[str]] = None) -> Optional[Path]:
    """The first candidate directory holding ``name`` (e.g. "cuda.h"), or None."""
    for d in candidate_dirs(env, sites):
        if (d / name).is_file():
            return d
    return None


def main(argv: Optional[list[str]] = None) -> int:
    """``python vmalloc/cuda_paths.py HEADER [SITE_DIR ...]``: prints the directory holding HEADER (the
    site-packages directories default to this interpreter's); exits 1, printing nothing, when none does."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python vmalloc/cuda_paths.py HEADER [SITE_DIR ...]", file=sys.stderr)
        return 2
    found = find_header(args[0], sites=args[1:] or None)
    if found is None:
        return 1
    print(found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
