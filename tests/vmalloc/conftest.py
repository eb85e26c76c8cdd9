from collections import Counter

import pytest

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
