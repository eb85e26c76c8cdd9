import sys
from pathlib import Path

# The repository root holds `bench` (benchmark code the tests drive) and tests/ holds tests_support;
# make both importable whatever the working directory.
HERE = Path(__file__).resolve().parent
for p in (HERE.parent, HERE):
    if str(p) not in sys.path:
        sys.path.append(str(p))

import pytest  # noqa: E402

FREEZE_LIMIT = 64 << 10  # CPU tensor bytes alive at collection's end above which nothing is frozen


def pytest_collection_finish(session: pytest.Session) -> None:
    """Moves everything alive once the tests are collected out of the collector's sight (``gc.freeze``).

    Note [Frozen before the tests]
    By the end of collection every test module and what it imports (torch, transformers, lightning, diffusers,
    hypothesis) is loaded: some 480,000 objects the garbage collector traversed at every full collection, for
    the rest of the session, though none of them is ever garbage. The suite collects often, by hand (a training
    run starts with ``gc.collect()`` so that a meter sees no earlier run's garbage, each file starts with one)
    and automatically (the oldest generation, as tests allocate), each full pass about 0.3 s of CPU here. Frozen,
    they are skipped: tests/swap/test_training.py took 40.1 s of CPU instead of 49.0, test_patterns.py with
    model_state/test_ms_memory.py 85.8 instead of 98.0 (wall 132 s against 214, 142 against 320, on the shared
    2-core VM at load ~10, 2026-11-28); at load 3-5, test_training.py 33.6 s of CPU instead of 39.4, 54.6 s wall
    instead of 57.5 (`/usr/bin/time`, a plugin calling ``gc.unfreeze()`` after this hook for the unfrozen run;
    the memory stalls of a traversal are what a loaded machine adds). Frozen objects are never collected, and
    ``gc.get_objects()`` (which ``LiveBytesMeter.track_existing`` reads: Note [What the CPU budget counts]) no
    longer lists them, so a CPU tensor alive at that point would be invisible to the budget's count; 3 tensors
    of 28 bytes in all were (the whole suite, measured), and if more than ``FREEZE_LIMIT`` bytes ever are,
    nothing is frozen."""
    import gc
    import warnings

    import torch

    gc.collect()
    alive = {}
    with warnings.catch_warnings():  # isinstance() pokes deprecated module attributes
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            try:
                if isinstance(o, torch.Tensor) and o.device.type == "cpu" and not o.is_meta:
                    st = o.untyped_storage()
                    alive[st.data_ptr()] = st.nbytes()
            except (ReferenceError, RuntimeError, NotImplementedError):  # a dead proxy, a tensor without storage
                continue
    if sum(alive.values()) <= FREEZE_LIMIT:
        gc.freeze()


@pytest.fixture
def torch_flags():
    """Sets PyTorch backend flags for one test and puts back what they were.

    Note [Backend flags are not attributes]
    ``torch.backends.cuda.matmul.allow_tf32`` and its kin are served by the module's ``__getattr__`` /
    ``__setattr__``, not stored on it, so ``monkeypatch.setattr`` cannot undo them: pytest 9.2 finds no attribute
    to restore and deletes it instead, which fails. Restoring by assignment, as a user sets them, always works.

        torch_flags(torch.backends.cuda.matmul, "allow_tf32", True)
    """
    saved = []

    def set_flag(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    yield set_flag
    for owner, name, value in reversed(saved):
        setattr(owner, name, value)


@pytest.fixture(autouse=True, scope="module")
def collect_before_each_file():
    """Frees what earlier test files left in reference cycles before a file starts. On the CPU the budget counts
    every live storage in the process (Note [What the CPU budget counts]): a managed run an earlier file left for
    the collector would count against this file's budgets as "not swappable"."""
    import gc

    gc.collect()
    yield
