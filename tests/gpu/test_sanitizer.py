"""The cuda-backend allocator tests once more under compute-sanitizer's memcheck (make gpu-sanitize runs the
same). Skipped where compute-sanitizer is not installed."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The short arena tests: every driver call path (create/map/access/unmap/release, events across streams,
# out-of-memory, bad frees, reclaim) with little kernel work, which memcheck slows down the most.
SUBSET = ["tests/gpu/test_cuda_arena.py", "-k", "granularity or out_of_memory or cross_stream or large_request"]


def find_sanitizer():
    return shutil.which("compute-sanitizer") or next(
        (str(p) for p in (Path("/usr/local/cuda/bin/compute-sanitizer"),) if p.is_file()), None
    )


@pytest.mark.skipif(os.environ.get("VMALLOC_UNDER_SANITIZER") == "1", reason="already under compute-sanitizer")
def test_arena_tests_pass_under_memcheck():
    tool = find_sanitizer()
    if tool is None:
        pytest.skip("compute-sanitizer is not installed")
    env = dict(os.environ, VMALLOC_UNDER_SANITIZER="1")
    cmd = [tool, "--tool", "memcheck", "--error-exitcode", "99",
           sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUBSET]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    assert "ERROR SUMMARY: 0 errors" in r.stdout + r.stderr
