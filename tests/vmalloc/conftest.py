import functools
import json
import os
import subprocess
import sys
import tempfile

import pytest
from backends import in_fake_driver_process
from run_summary import SUMMARY

import vmalloc

KiB, MiB = 1024, 1024 * 1024


@pytest.fixture
def make_arena():
    """Host-backend arenas with small chunks, checked for consistency at teardown."""
    arenas = []

    def make(**kw):
        kw.setdefault("backend", "host")
        kw.setdefault("capacity", 16 * MiB)
        kw.setdefault("chunk_size", 64 * KiB)
        kw.setdefault("small_max", 16 * KiB)
        kw.setdefault("mid_chunks", 0)  # chunk-granular requests above small_max (tests/vmalloc/test_mid_blocks.py)
        arena = vmalloc.Arena(**kw)
        arenas.append(arena)
        return arena

    yield make
    for a in arenas:
        a.check_invariants()


def pytest_terminal_summary(terminalreporter):
    for line in SUMMARY.lines():
        terminalreporter.write_line(line)


def pytest_sessionfinish(session):
    out = os.environ.get("VMALLOC_RUN_SUMMARY_OUT")
    if out and in_fake_driver_process():
        with open(out, "w") as f:
            f.write(SUMMARY.to_json())
    results = os.environ.get("VMALLOC_CHILD_RESULTS")
    if results and in_fake_driver_process():
        with open(results, "w") as f:
            json.dump(_CHILD_OUTCOMES, f)


# Note [cuda tests in a child process] (backends.py): tests on the emulated driver run in a child pytest,
# one child per test module, whose outcomes the parent reports test by test.

_CHILD_OUTCOMES: dict[str, dict[str, str]] = {}  # in a child: nodeid -> outcome and failure text
_PARENT_RESULTS: dict[str, dict[str, dict[str, str]]] = {}  # in the parent: module path -> the child's outcomes
_CHILD_ITEMS: dict[str, list] = {}  # in the parent: module path -> its items that run in the child


def pytest_runtest_logreport(report):
    if not in_fake_driver_process():
        return
    entry = _CHILD_OUTCOMES.setdefault(report.nodeid, {"outcome": "passed", "text": ""})
    if report.failed:
        entry["outcome"] = "failed"
        entry["text"] += f"[{report.when}] {report.longreprtext}\n"
    elif report.skipped and report.when in ("setup", "call"):
        entry["outcome"] = "skipped"
        entry["text"] += str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda_fake: runs on the cuda backend against the emulated driver, in a child process"
    )


def _needs_child(item) -> bool:
    if in_fake_driver_process():
        return False
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "cuda":
        return True
    return item.get_closest_marker("cuda_fake") is not None


def _run_module_in_child(path: str, items: list) -> dict[str, dict[str, str]]:
    from fakecuda.build import ensure_built

    library = ensure_built()
    nodes = [path + item.nodeid[item.nodeid.index("::"):] for item in items]
    with tempfile.TemporaryDirectory() as tmp:
        summary, results = os.path.join(tmp, "summary.json"), os.path.join(tmp, "results.json")
        env = {**os.environ, "VMALLOC_LIBCUDA": str(library), "VMALLOC_RUN_SUMMARY_OUT": summary,
               "VMALLOC_CHILD_RESULTS": results}
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={items[0].config.rootpath}",
             *nodes],
            env=env, capture_output=True, text=True, timeout=1800,
        )
        if os.path.exists(summary):
            with open(summary) as f:
                SUMMARY.merge_json(f.read())
        if not os.path.exists(results):
            raise AssertionError(f"the child pytest on the emulated driver died (rc {proc.returncode}):\n"
                                 f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
        with open(results) as f:
            return json.load(f)


def _run_in_child(item) -> None:
    path = str(item.path)
    if path not in _PARENT_RESULTS:
        _PARENT_RESULTS[path] = _run_module_in_child(path, _CHILD_ITEMS[path])
    result = _PARENT_RESULTS[path].get(item.nodeid)
    if result is None:
        raise AssertionError(f"the child pytest on the emulated driver did not run {item.nodeid}")
    if result["outcome"] == "failed":
        raise AssertionError(f"on the emulated driver (child process):\n{result['text']}")
    if result["outcome"] == "skipped":
        pytest.skip(f"in the child process: {result['text']}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _needs_child(item):
            _CHILD_ITEMS.setdefault(str(item.path), []).append(item)
            item.runtest = functools.partial(_run_in_child, item)
