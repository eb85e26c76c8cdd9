"""The variable sequence: what the profiling iteration records and the scheduler plans against.

A *step* is one access to a saved activation, in the order autograd makes them: every pack (the forward
saves it, or saves the same storage again) and every unpack (a backward node reads it). This is the
flattened variable sequence v of the window-scheduling paper (arXiv 2010.14109), restricted to the variables that may
be swapped; everything else on the device is folded into ``nonswap[i]``, the measured bytes that are not ours to move
during step i.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

SAVE, USE = "save", "use"


@dataclass
class Sequence:
    """One iteration's accesses to swappable variables.

    Attributes:
        var: the variable accessed at each step.
        kind: ``"save"`` (pack hook: the forward saves it) or ``"use"`` (unpack hook: backward reads it).
        sizes: bytes of each variable (its whole storage).
        nonswap: device bytes that are not swappable variables, at their highest during each step (the
            measured peak of the step less the variables held resident then).
        compute: seconds of compute in each step (until the next access).
        swappable: per variable; False keeps it resident (e.g. its storage outlives the iteration, so
            swapping it would free nothing).
        held_until: per variable, the first step at which dropping our copy frees its memory: before it,
            the forward pass itself still holds the tensor (a residual input waiting for its add), so a
            release would free nothing. Default 0 (no constraint: a recorded run's ``nonswap`` already
            counts what the forward held). A profiled run records it and leaves those bytes out of
            ``nonswap``: the scheduler counts them as resident until then.
        freed: per variable, the first step at which it is gone: autograd released every saved handle of
            it (the node that used it last has run, or its graph was dropped). Default: the step after its
            last access. A variable of a graph that outlives the iteration (``retain_graph``, a forward
            never backpropagated while its output is still referenced) has ``len(self)``.
        modules: per variable, the path of the module whose forward saved it (``"encoder.layer.3.attention"``;
            empty or "" when unknown). Errors name the module rather than a step index.
        transient: per step, the part of ``nonswap[i]`` the step's operations allocated above what was live
            when the step began (outputs and temporaries). Default 0.
        kept: per step, bytes of saved tensors that stay on the device because of ``min_bytes`` or
            ``exclude`` (part of ``nonswap[i]``). Default 0.
        base: bytes live when the iteration began (parameters, gradients, optimizer state, inputs): part of
            every step's ``nonswap``. Default 0.
        node_last: per step, for a use, the last step of the backward node that made it: a node holds what
            it unpacked until it has run, so the variable used at step i frees nothing if released before
            ``node_last[i] + 1`` (a compiled region's backward unpacks all its saved tensors at once).
            Default: the step itself.
        clean: per variable, True when its host copy is always valid (Note [Clean variables]). Default all
            False (every variable is an activation the forward makes).
        saved_before: per step, how many tensors the iteration had saved by then, ours or not (a recorded
            run's; empty when unknown). A later iteration repeats the step only at the same count: a tensor that
            stopped being ours (under ``min_bytes`` at a smaller input) shifts it (Note [Plans by input shape]
            in swap.runtime.activations.plan_book).

    Note [Clean variables]
    A clean variable is one whose host copy is its home and stays valid: a bucket of weights streamed from
    the host master. It starts the iteration on the host, not on the device, so its first access may be a
    use (a fetch from the host, prefetched by the window like any other use); leaving the device is a drop,
    with no copy out (its device bytes are free at once, nothing to wait for); the simulator charges it no
    D2H time or bytes. Everything else about it (its bytes, its uses, the budget) is a variable's.
    """

    var: list[int]
    kind: list[str]
    sizes: list[int]
    nonswap: list[int]
    compute: list[float]
    swappable: list[bool] = field(default_factory=list)
    held_until: list[int] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    transient: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    base: int = 0
    node_last: list[int] = field(default_factory=list)
    clean: list[bool] = field(default_factory=list)
    saved_before: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.var)
        if not (len(self.kind) == len(self.nonswap) == len(self.compute) == n):
            raise ValueError("var, kind, nonswap and compute must have one entry per step")
        if not self.swappable:
            self.swappable = [True] * len(self.sizes)
        if len(self.swappable) != len(self.sizes):
            raise ValueError("swappable must have one entry per variable")
        if not self.held_until:
            self.held_until = [0] * len(self.sizes)
        if len(self.held_until) != len(self.sizes):
            raise ValueError("held_until must have one entry per variable")
        for name in ("freed", "modules"):
            if getattr(self, name) and len(getattr(self, name)) != len(self.sizes):
                raise ValueError(f"{name} must have one entry per variable")
        if not self.transient:
            self.transient = [0] * n
        if not self.kept:
            self.kept = [0] * n
        if not self.node_last:
            self.node_last = list(range(n))
        if (len(self.transient) != n or len(self.kept) != n or len(self.node_last) != n
                or len(self.saved_before) not in (0, n)):  # fmt: skip
            raise ValueError("transient, kept, node_last and saved_before must have one entry per step")
        if any(last < i for i, last in enumerate(self.node_last)):
            raise ValueError("node_last[i] must not be before step i")
        if any(v < 0 or v >= len(self.sizes) for v in self.var):
            raise ValueError("a step names a variable that has no size")
        if not self.clean:
            self.clean = [False] * len(self.sizes)
        if len(self.clean) != len(self.sizes):
            raise ValueError("clean must have one entry per variable")
        seen: set[int] = {v for v, c in enumerate(self.clean) if c}  # on the host from the start
        for i, (v, k) in enumerate(zip(self.var, self.kind)):
            if k not in (SAVE, USE):
                raise ValueError(f"step {i}: kind must be 'save' or 'use', not {k!r}")
            if v not in seen and k != SAVE:
                raise ValueError(f"step {i}: variable {v} is used before it is saved (only a clean variable, whose "
                                 "home is the host, may be fetched first)")
            seen.add(v)

    def __len__(self) -> int:
        return len(self.var)

    def save(self, path: Union[str, Path], meta: Optional[dict[str, Any]] = None) -> Path:
        """Writes the sequence (and ``meta``: device, measured bandwidths, ...) as JSON."""
        path = Path(path)
        path.write_text(json.dumps({"format": "swap.sequence/1", "meta": meta or {}, **asdict(self)}) + "\n")
        return path

    @classmethod
    def load(cls, path: Union[str, Path]) -> tuple[Sequence, dict[str, Any]]:
        """Reads a file written by ``save`` (e.g. ``SwapManager.save_profile``): (sequence, meta)."""
        data = json.loads(Path(path).read_text())
        if data.pop("format", None) != "swap.sequence/1":
            raise ValueError(f"{path} is not a swap sequence profile (written by SwapManager.save_profile)")
        meta = data.pop("meta", {})
        return cls(**data), meta

    def next_access(self) -> list[int]:
        """For each step, the next step that accesses the same variable (len(self) if none)."""
        n = len(self.var)
        nxt = [n] * n
        last: dict[int, int] = {}
        for i in range(n - 1, -1, -1):
            nxt[i] = last.get(self.var[i], n)
            last[self.var[i]] = i
        return nxt

    def signature(self) -> list[tuple[str, int]]:
        """What a later iteration must repeat for the plan to apply: (kind, bytes) per step."""
        return [(k, self.sizes[v]) for v, k in zip(self.var, self.kind)]

    def ends(self) -> list[int]:
        """Per variable, the first step at which it is gone: after its last access, or at ``freed``."""
        n = len(self.var)
        end = [0] * len(self.sizes)
        for i, v in enumerate(self.var):
            end[v] = i + 1
        if self.freed:
            end = [min(n, max(e, f)) for e, f in zip(end, self.freed)]
        return end

    def live_bytes(self) -> list[int]:
        """Bytes of swappable variables alive (saved, not yet gone: see ``ends``) at each step: what the
        device would hold without swapping."""
        n = len(self.var)
        first: dict[int, int] = {}
        for i, v in enumerate(self.var):
            first.setdefault(v, i)
        end = self.ends()
        delta = [0] * (n + 1)
        for v, f in first.items():
            if self.swappable[v]:
                delta[f] += self.sizes[v]
                delta[end[v]] -= self.sizes[v]
        out, cur = [], 0
        for i in range(n):
            cur += delta[i]
            out.append(cur)
        return out

    def no_swap_peak(self) -> int:
        """The device peak if nothing were swapped."""
        return max((n + live for n, live in zip(self.nonswap, self.live_bytes())), default=0)

    def step_floor(self) -> int:
        """The least any schedule needs: the largest step's unswappable bytes plus the variable it touches
        (``swap.schedule.budget.min_budget`` is the finer floor, with what a step must hold besides)."""
        return max((self.nonswap[i] + self.sizes[self.var[i]] for i in range(len(self))), default=0)
