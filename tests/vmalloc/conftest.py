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
