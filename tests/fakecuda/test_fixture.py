"""The `fakecuda` fixture fails a test whose stream work the race detector flagged, and passes a clean one."""

import os
import subprocess
import sys
import textwrap

from fakecuda.build import ROOT, ensure_built

TESTS = '''
def test_clean(fakecuda):
    s = fakecuda.stream()
    ptr, handle = fakecuda.map_new(fakecuda.granularity())
    fakecuda.fill(s, ptr, 64, 1)
    fakecuda.synchronize(s)
    fakecuda.unmap_free(ptr, fakecuda.granularity(), handle)


def test_racy(fakecuda):
    a, b = fakecuda.stream(), fakecuda.stream()
    ptr, handle = fakecuda.map_new(fakecuda.granularity())
    fakecuda.fill(a, ptr, 64, 1, 100_000)
    fakecuda.check_reuse(b, ptr, 64)
'''


def test_fixture_fails_a_test_with_violations(tmp_path):
    ensure_built()
    (tmp_path / "conftest.py").write_text("from fakecuda.fixtures import fakecuda  # noqa: F401\n")
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(TESTS))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "2 passed, 1 error" in out  # test_racy itself passes; its teardown fails it
    assert "ERROR at teardown of test_racy" in out and "fakecuda recorded 1 violation(s)" in out
    assert "[reuse-unordered]" in out and "test_clean" not in out.split("short test summary")[1]
