"""Where the emulated driver library is, and building it (``make fakecuda``) when needed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LIBRARY = ROOT / "build" / "fakecuda" / "libcuda.so.1"

_built = False


def library_path() -> Path:
    """The library tests load: ``$FAKECUDA_LIBRARY`` if set (e.g. the ASan build), else the default build."""
    return Path(os.environ.get("FAKECUDA_LIBRARY") or DEFAULT_LIBRARY)


def ensure_built() -> Path:
    """Runs ``make fakecuda`` once per process (a no-op when up to date) and returns the library's path.

    With ``$FAKECUDA_LIBRARY`` set, that file is used as it is and must exist.
    """
    global _built
    path = library_path()
    if os.environ.get("FAKECUDA_LIBRARY"):
        if not path.exists():
            raise FileNotFoundError(f"FAKECUDA_LIBRARY={path} does not exist; build it with `make fakecuda`")
        return path
    if not _built:
        make = shutil.which("make")
        if make is None:
            raise RuntimeError("`make` is needed to build the emulated driver (make fakecuda)")
        proc = subprocess.run([make, "-s", "-C", str(ROOT), "fakecuda"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"`make fakecuda` failed:\n{proc.stdout}\n{proc.stderr}")
        _built = True
    return path
