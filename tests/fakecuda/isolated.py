"""Running code in a fresh Python process, for what is read once per process: FAKECUDA_* configuration,
FAKECUDA_FAIL, and VMALLOC_LIBCUDA (read when the cuda backend first loads a driver)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from .build import ROOT, ensure_built


def run_isolated(code: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """Runs `code` (dedented) in a new interpreter with `env` added; `fakecuda` and the repository's packages
    are importable there. Returns the finished process (output captured as text)."""
    ensure_built()
    full_env = dict(os.environ)
    full_env.update(env)
    paths = [str(ROOT / "tests"), str(ROOT)]
    if full_env.get("PYTHONPATH"):
        paths.append(full_env["PYTHONPATH"])
    full_env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
