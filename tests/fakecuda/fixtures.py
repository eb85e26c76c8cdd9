"""The pytest fixture for tests on the emulated driver. Use it from any test package with
``from fakecuda.fixtures import fakecuda  # noqa: F401`` in that package's conftest.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .api import FakeCuda, driver


@pytest.fixture
def fakecuda() -> Iterator[FakeCuda]:
    """The emulated driver, with no fault rules and nothing recorded; at teardown, once all stream work has
    run, the test fails if the race detector recorded any violation (a test that provokes violations on
    purpose consumes them with ``take_violations()``)."""
    fc = driver()
    fc.set_faults("")
    fc.reset()
    yield fc
    fc.set_faults("")
    fc.drain()
    found = fc.violations()
    fc.reset()
    assert not found, f"fakecuda recorded {len(found)} violation(s):\n\n" + "\n\n".join(found)
