"""Traces at any batch size from two captures, when the trace is provably linear in the batch.

Note [Linear traces]
For most models, one training step at batch n runs the same operators in the same order whatever n is, and
every tensor is either independent of the batch (weights, optimizer state) or proportional to it
(activations). Then the event arrays (op, id, tag, and the operators' module, phase and precision) and the
operator and module tables are identical across batch sizes, and each event's bytes, FLOPs and bytes moved
(an operator's own, or a segment's sum in older traces) are a + b*n. ``LinearTrace.fit`` checks the first
part exactly on two captures and derives (a, b) per event; ``check`` compares a third capture with the
extrapolation, event by event (sizes exactly, FLOPs and bytes moved to 1e-9). A model that breaks
linearity (control flow on the batch size, an n x n similarity matrix) fails the check, and the planner
captures every batch it evaluates instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .trace import Trace

_SAME = ("module", "phase", "precision")  # per-event fields that must not depend on the batch


@dataclass
class LinearTrace:
    """A trace whose per-event sizes and costs are ``base + slope * batch``."""

    template: Trace
    size: tuple[np.ndarray, np.ndarray]  # int64 (base, slope)
    flops: tuple[np.ndarray, np.ndarray]
    bytes: tuple[np.ndarray, np.ndarray]

    @classmethod
    def fit(cls, a: Trace, b: Trace) -> Optional[LinearTrace]:
        """The linear model through two captures at different batches, or None if their events differ."""
        na, nb = int(a.meta["batch"]), int(b.meta["batch"])
        if na == nb or len(a) != len(b):
            return None
        if not all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("op", "id", "tag", *_SAME)):
            return None
        if any(a.meta.get(k) != b.meta.get(k) for k in ("ops", "modules")):
            return None
        ds = b.size - a.size
        if np.any(ds % (nb - na)):
            return None  # a size that does not grow by whole bytes per sample
        slope = ds // (nb - na)
        base = a.size - slope * na
        if np.any(base + slope * 1 < 0):
            return None

        def line(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            s = (y - x) / (nb - na)
            return x - s * na, s

        return cls(a, (base, slope), line(a.flops, b.flops), line(a.bytes, b.bytes))

    def at(self, batch: int) -> Trace:
        t = self.template
        meta = dict(t.meta, batch=batch, source="capture (linear in the batch, Note [Linear traces])")
        return Trace(
            t.op, t.id, self.size[0] + self.size[1] * batch, t.tag, t.stream,
            np.maximum(0.0, self.flops[0] + self.flops[1] * batch),
            np.maximum(0.0, self.bytes[0] + self.bytes[1] * batch), meta, t.module, t.phase, t.precision,
        )  # fmt: skip

    def check(self, captured: Trace) -> Optional[str]:
        """None if ``captured`` is what the model predicts at its batch, else what differs."""
        n = int(captured.meta["batch"])
        want = self.at(n)
        if len(want) != len(captured) or not all(np.array_equal(getattr(want, k), getattr(captured, k))
                                                 for k in ("op", *_SAME)):  # fmt: skip
            return f"batch {n} runs a different sequence of events ({len(captured)} vs {len(want)})"
        bad = np.flatnonzero(want.size != captured.size)
        if len(bad):
            k = int(bad[0])
            return f"batch {n}: event {k} has {int(captured.size[k])} bytes, linear extrapolation {int(want.size[k])}"
        for name in ("flops", "bytes"):
            got, exp = getattr(captured, name), getattr(want, name)
            if not np.allclose(got, exp, rtol=1e-9, atol=1e-6):
                k = int(np.flatnonzero(~np.isclose(got, exp, rtol=1e-9, atol=1e-6))[0])
                return f"batch {n}: event {k} {name} {got[k]:.6g}, linear extrapolation {exp[k]:.6g}"
        return None
