"""What the allocator tests did in this run: operations per backend and backend faults injected and
survived per call; conftest.py prints it at the end of the session (and children on the emulated driver
hand theirs to the parent)."""

from __future__ import annotations

import json
from collections import Counter


class RunSummary:
    def __init__(self) -> None:
        self.ops: Counter = Counter()  # by backend: "host", "cuda", "sim"
        self.faults: Counter = Counter()  # injected faults that fired, by backend call
        self.raised = 0  # of which surfaced as vmalloc.BackendError

    def count_ops(self, backend: str, n: int) -> None:
        self.ops[backend] += n

    def count_faults(self, call: str, fired: int, raised: int) -> None:
        self.faults[call] += fired
        self.raised += raised

    def to_json(self) -> str:
        return json.dumps({"ops": self.ops, "faults": self.faults, "raised": self.raised})

    def merge_json(self, text: str) -> None:
        d = json.loads(text)
        self.ops.update(d["ops"])
        self.faults.update(d["faults"])
        self.raised += d["raised"]

    def lines(self) -> list[str]:
        if not self.ops and not self.faults:
            return []
        per_backend = ", ".join(f"{b} {n}" for b, n in sorted(self.ops.items()))
        per_call = ", ".join(f"{c} {n}" for c, n in sorted(self.faults.items()))
        return [
            f"vmalloc allocator tests: {sum(self.ops.values())} operations ({per_backend}; cuda = the emulated "
            f"driver, sim = bookkeeping without bytes); {sum(self.faults.values())} injected backend faults "
            f"survived ({self.raised} raised "
            f"BackendError), per call: {per_call or 'none'}"
        ]


SUMMARY = RunSummary()
