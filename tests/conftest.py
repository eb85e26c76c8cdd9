import sys
from pathlib import Path

# The repository root holds `bench` (benchmark code the tests drive) and tests/ holds tests_support;
# make both importable whatever the working directory.
HERE = Path(__file__).resolve().parent
for p in (HERE.parent, HERE):
    if str(p) not in sys.path:
        sys.path.append(str(p))

import pytest  # noqa: E402


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
