import sys
from pathlib import Path

# The repository root holds `bench` (benchmark code the tests drive) and tests/ holds tests_support;
# make both importable whatever the working directory.
HERE = Path(__file__).resolve().parent
for p in (HERE.parent, HERE):
    if str(p) not in sys.path:
        sys.path.append(str(p))
