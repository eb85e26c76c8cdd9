"""Stand-in checks for tests/gpu/test_quick.py: one passes, one fails, one raises, one hangs (with a process of
its own still running), one dies without a result."""

import os
import subprocess
import sys
import time

from bench.gpu.quick import Check, Outcome


def hangs() -> Outcome:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(os.environ["QUICK_FAKE_PID_FILE"], "w") as f:
        f.write(str(sleeper.pid))
    print("waiting for a device that never answers", flush=True)
    time.sleep(120)
    return Outcome(True, "never")


def raises() -> Outcome:
    raise ValueError("the adapter is a fake\nsecond line")


def dies() -> Outcome:
    print("about to die", flush=True)
    os._exit(3)


CHECKS = [
    Check("passes", "a check that passes", 60, lambda: Outcome(True, "42 things", {"n": 42})),
    Check("fails", "a check that fails", 60, lambda: Outcome(False, "7 over the budget")),
    Check("raises", "a check that raises", 60, raises),
    Check("hangs", "a check that hangs", 3, hangs),
    Check("dies", "a check whose process dies", 60, dies),
]
