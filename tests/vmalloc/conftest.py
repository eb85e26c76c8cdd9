import functools
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter

import pytest
from backends import in_fake_driver_process

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
        arena = vmalloc.Arena(**kw)
        arenas.append(arena)
        return arena

    yield make
    for a in arenas:
        a.check_invariants()


class FaultSummary:
    """Operations run and backend faults survived by the fault sweeps, per backend call; printed at the end
    of the session (the figures the issue asks to report per CI run)."""

    def __init__(self) -> None:
        self.ops = Counter()
        self.faults = Counter()
        self.errors = Counter()

    def add(self, call: str, ops: int, faults: int, errors: int) -> None:
        self.ops[call] += ops
        self.faults[call] += faults
        self.errors[call] += errors

    def to_json(self) -> str:
        return json.dumps({"ops": self.ops, "faults": self.faults, "errors": self.errors})

    def merge_json(self, text: str) -> None:
        d = json.loads(text)
        for name in ("ops", "faults", "errors"):
            getattr(self, name).update(d[name])

    def lines(self) -> list[str]:
        if not self.ops:
            return []
        per_call = ", ".join(f"{c} {self.faults[c]}" for c in sorted(self.faults))
        return [
            f"vmalloc fault sweeps: {sum(self.ops.values())} operations, {sum(self.faults.values())} injected "
            f"faults survived ({sum(self.errors.values())} surfaced as BackendError); faults per call: {per_call}"
        ]


_SUMMARY = FaultSummary()


@pytest.fixture(scope="session")
def fault_summary() -> FaultSummary:
    return _SUMMARY


def pytest_terminal_summary(terminalreporter):
    for line in _SUMMARY.lines():
        terminalreporter.write_line(line)


def pytest_sessionfinish(session):
    out = os.environ.get("VMALLOC_FAULT_SUMMARY_OUT")
    if out and in_fake_driver_process():
        with open(out, "w") as f:
            f.write(_SUMMARY.to_json())


# Note [cuda tests in a child process] (backends.py): tests on the emulated driver run in a child pytest.


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


def _run_in_child(item) -> None:
    from fakecuda.build import ensure_built

    library = ensure_built()
    node = str(item.path) + item.nodeid[item.nodeid.index("::"):]
    with tempfile.NamedTemporaryFile("r", suffix=".json") as summary:
        env = {**os.environ, "VMALLOC_LIBCUDA": str(library), "VMALLOC_FAULT_SUMMARY_OUT": summary.name}
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"--rootdir={item.config.rootpath}",
             node],
            env=env, capture_output=True, text=True, timeout=900,
        )
        text = summary.read()
    if text:
        _SUMMARY.merge_json(text)
    if proc.returncode != 0:
        raise AssertionError(f"on the emulated driver (child pytest, rc {proc.returncode}):\n"
                             f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _needs_child(item):
            item.runtest = functools.partial(_run_in_child, item)
