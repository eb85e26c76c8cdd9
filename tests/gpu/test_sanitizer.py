"""The cuda-backend allocator tests once more under compute-sanitizer's memcheck (make gpu-sanitize runs the
same). Skipped where compute-sanitizer is not installed, or where it cannot instrument this machine's device
(see sanitizer_verdict)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The short arena tests: every driver call path (create/map/access/unmap/release, events across streams,
# out-of-memory, bad frees, reclaim) with little kernel work, which memcheck slows down the most.
SUBSET = ["tests/gpu/test_cuda_arena.py", "-k", "granularity or out_of_memory or cross_stream or large_request"]


# Note [compute-sanitizer cannot run here]
# Some machines have a GPU that compute-sanitizer refuses: sandboxed ones (gVisor) print "Device not
# supported", others cannot attach to the target. That says nothing about our code, so the test skips with the
# sanitizer's own line as the reason; every other non-zero exit (memcheck errors, a failing test) still fails.
UNSUPPORTED = re.compile(r"device not supported|(?:cannot|can't|could not|unable to|failed to) attach", re.I)


def sanitizer_verdict(returncode: int, output: str) -> tuple[str, str]:
    """What a compute-sanitizer run means: ("pass", ""), ("skip", the line that says why the sanitizer could
    not run), or ("fail", why)."""
    match = UNSUPPORTED.search(output)
    if returncode != 0 and match:
        line_start = output.rfind("\n", 0, match.start()) + 1
        line_end = output.find("\n", match.end())
        line = output[line_start : None if line_end < 0 else line_end].strip(" =\t")
        return "skip", f"compute-sanitizer cannot run on this device: {line}"
    if returncode != 0:
        return "fail", f"compute-sanitizer exited with {returncode}"
    if "ERROR SUMMARY: 0 errors" not in output:
        return "fail", "compute-sanitizer exited 0 without 'ERROR SUMMARY: 0 errors'"
    return "pass", ""


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
    verdict, why = sanitizer_verdict(r.returncode, r.stdout + r.stderr)
    if verdict == "skip":
        pytest.skip(why)
    assert verdict == "pass", f"{why}\n{' '.join(cmd)}\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"


SUMMARY_OK = "========= ERROR SUMMARY: 0 errors\n"


@pytest.mark.cpu
@pytest.mark.parametrize(
    "returncode, output, verdict, reason_part",
    [
        (0, "1 passed\n" + SUMMARY_OK, "pass", ""),
        (1, "========= COMPUTE-SANITIZER\n========= Error: Device not supported\n", "skip", "Device not supported"),
        (255, "========= Error: Failed to attach to the target process\n", "skip", "Failed to attach"),
        (99, "========= Invalid __global__ read of size 4\n========= ERROR SUMMARY: 1 error\n", "fail", "99"),
        (1, "FAILED tests/gpu/test_cuda_arena.py::test_granularity\n" + SUMMARY_OK, "fail", "exited with 1"),
        (0, "1 passed\n", "fail", "without 'ERROR SUMMARY"),
        # The words alone (here in a test's log) do not turn a clean run into a skip.
        (0, "Device not supported\n" + SUMMARY_OK, "pass", ""),
    ],
)
def test_sanitizer_verdict(returncode, output, verdict, reason_part):
    got, why = sanitizer_verdict(returncode, output)
    assert got == verdict
    assert reason_part in why
