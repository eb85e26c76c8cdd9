"""The operator table: what the planner knows about each forward operator, and which modules may become
recompute regions. Pure data: the runtime's operator profiler (swap.runtime.auto.op_profiler) builds it from a
profiled iteration, and a captured trace (swap.capture) can build the same from its OP events.

Note [Operator table]
The plan's unit is the saved variable of a ``Sequence``; an operator is how a variable comes to exist. Per
forward operator the table holds its name (``aten.addmm.default``), the innermost module it ran in, its
seconds (measured host time on CPU, the roofline elsewhere), FLOPs and bytes moved, the bytes of its
outputs, which sequence variables its output and input storages are, and whether it can be rerun: an
operator that cannot (``blocker``) is never recomputed, its outputs are kept (saved, and so swappable).
``step`` places it in the sequence: the number of steps (saved-tensor accesses) taken before it ran, so its
own saves come at ``step`` or later.

A *region call* is one call of a candidate module: its operators, the sequence steps its saves made, and the
tensors a non-reentrant checkpoint of it would save as its inputs (the call's tensor arguments, keyword
arguments included), each as the variable it is in the sequence, or a negative id when the profiled run
never saved that storage (the same negative id is the same storage). Operators' output and input storages
are numbered the same way; storages the runtime would not manage (smaller than ``min_bytes``, parameters)
are left out.

Note [Candidate regions]
Regions are the repeated children of containers, found from module paths alone so a trace works as well as
a live model: a module whose path ends in an index (``transformer.h.3``, ``encoder.layer.0``,
``resnet.encoder.stages.1.layers.2``, ``layer3.4``) is a child of an ``nn.ModuleList`` or ``nn.Sequential``,
which is how transformer layers and ResNet bottlenecks are built, in Hugging Face's models and ours alike.
The paths with their indices replaced by ``*`` form *levels* (``resnet.encoder.stages.*`` and
``resnet.encoder.stages.*.layers.*``); a plan checkpoints modules of one level per branch, never a module
inside another checkpointed one. Which level is "the block" is not guessed: the baselines try each level
and the planner keeps the fastest (HF's ``gradient_checkpointing_enable`` wraps the outermost, a ResNet's
bottlenecks are the inner one).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field, replace
from typing import Optional

# Operators whose outputs are worth keeping in "selective" checkpointing (torchtitan, Megatron): the costly
# ones per byte. Matched on the operator's name.
SELECTIVE = re.compile(r"\b(aten\.)?(mm|addmm|bmm|baddbmm|matmul|linear|convolution|conv\w*|_convolution"
                       r"|cudnn_convolution\w*|_scaled_dot_product\w*|scaled_dot_product\w*|_flash_attention\w*|_efficient_attention\w*"
                       r"|_scaled_mm)\b")  # fmt: skip

_INDEX = re.compile(r"^\d+$")


def in_place_name(name: str) -> bool:
    """Whether an operator's name is an in-place ATen overload's (``aten.add_.Tensor``): it writes an argument."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[1].endswith("_")


@dataclass(frozen=True)
class Op:
    """One forward operator (Note [Operator table])."""

    name: str
    module: str = ""
    seconds: float = 0.0
    flops: float = 0.0
    nbytes: float = 0.0  # bytes read and written
    out_bytes: int = 0
    step: int = 0  # sequence steps taken before it ran
    outputs: tuple[int, ...] = ()  # its output storages: sequence variables, or negative ids if never saved
    sizes: tuple[int, ...] = ()  # bytes of each output storage
    inputs: tuple[int, ...] = ()  # its input storages, numbered like ``outputs``
    keepable: bool = True  # out of place, tensor outputs not written in place later: they can be kept
    blocker: str = ""  # why it cannot be recomputed ("" if it can)
    rng: bool = False  # draws from torch's default generator (replayed by checkpoint's preserve_rng_state)


@dataclass(frozen=True)
class RegionCall:
    """One call of a candidate module (Note [Operator table])."""

    path: str
    ops: tuple[int, int]  # [first, end) indices into OpTable.ops
    steps: tuple[int, int]  # [first, end) sequence steps made during the call
    inputs: tuple[tuple[int, int], ...] = ()  # (variable, or a negative id for an unsaved storage; bytes)
    blocker: str = ""  # why it cannot be checkpointed ("" if it can)


@dataclass
class OpTable:
    """The forward operators of one profiled iteration and the calls of candidate modules."""

    ops: list[Op] = field(default_factory=list)
    calls: list[RegionCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        for c in self.calls:
            a, b = c.ops
            if not 0 <= a <= b <= len(self.ops):
                raise ValueError(f"region call {c.path!r}: operators [{a}, {b}) outside the table of {len(self.ops)}")
            if c.steps[0] > c.steps[1]:
                raise ValueError(f"region call {c.path!r}: steps {c.steps} run backwards")

    def calls_of(self, path: str) -> list[RegionCall]:
        return [c for c in self.calls if c.path == path]

    def op_keys(self, call: RegionCall) -> list[tuple[str, int]]:
        """Each operator of ``call`` as (name, ordinal of that name within the call): how the runtime finds the
        same operator when the call is rerun (``Region.keep`` holds such keys)."""
        seen: dict[str, int] = {}
        keys = []
        for op in self.ops[call.ops[0] : call.ops[1]]:
            k = seen.get(op.name, 0)
            seen[op.name] = k + 1
            keys.append((op.name, k))
        return keys

    def blocked(self, path: str) -> str:
        """Why the module at ``path`` cannot be checkpointed, or "" if it can."""
        calls = self.calls_of(path)
        if not calls:
            return "it did not run in the profiled iteration"
        return next((c.blocker for c in calls if c.blocker), "")

    def levels(self) -> dict[str, list[str]]:
        """Candidate regions by level (Note [Candidate regions]): pattern -> paths in first-call order, only
        modules that can be checkpointed and whose calls saved something."""
        out: dict[str, list[str]] = {}
        for c in self.calls:
            parts = c.path.split(".")
            if not parts or not is_index(parts[-1]) or c.steps[0] == c.steps[1]:
                continue
            pattern = ".".join("*" if is_index(p) else p for p in parts)
            paths = out.setdefault(pattern, [])
            if c.path not in paths:
                paths.append(c.path)
        return {k: [p for p in v if not self.blocked(p)] for k, v in out.items() if any(not self.blocked(p) for p in v)}

    def level_sets(self, limit: int = 16) -> dict[str, list[str]]:
        """Ways to checkpoint "every block" (Note [Candidate regions]): one level from each family of nested
        levels (T5: its encoder's and its decoder's blocks, or their layers), by name ("a+b") -> paths. Past
        ``limit`` combinations, only the all-outermost and all-innermost ones and those differing from the
        all-outermost in one family."""
        levels = self.levels()
        families: list[list[str]] = []
        for p in sorted(levels, key=len):
            fam = next((f for f in families if any(nested(p, q) or nested(q, p) for q in f)), None)
            if fam is None:
                families.append([p])
            else:
                fam.append(p)
        combos = list(itertools.product(*families))
        if len(combos) > limit:
            outer = tuple(f[0] for f in families)
            combos = [outer, tuple(f[-1] for f in families)]
            combos += [outer[:k] + (alt,) + outer[k + 1 :] for k, f in enumerate(families) for alt in f[1:]]
        out: dict[str, list[str]] = {}
        for combo in combos:
            out.setdefault("+".join(combo), [p for level in combo for p in levels[level]])
        return out

    def keep_candidates(self, call: RegionCall, saved: set[int]) -> list[int]:
        """Operators of ``call`` whose outputs may be kept instead of recomputed: keepable, and an output is a
        variable the call saves (``saved``), so the rerun reads it back before it stops (Note [Early stop])."""
        return [j for j in range(*call.ops) if self.ops[j].keepable and any(v in saved for v in self.ops[j].outputs)]

    def forced(self, call: RegionCall) -> list[int]:
        """Operators of ``call`` that cannot be rerun: they are kept whatever the plan says."""
        return [j for j in range(*call.ops) if self.ops[j].blocker]


def is_selective(name: str) -> bool:
    """Whether selective checkpointing keeps this operator's output (matmuls, convolutions, attention)."""
    return SELECTIVE.search(name) is not None


def is_index(part: str) -> bool:
    """Whether a module path's part is an index into a container (Note [Candidate regions])."""
    return _INDEX.match(part) is not None


def nested(inner: str, outer: str) -> bool:
    return inner.startswith(outer + ".")


def check_regions(table: OpTable, paths: list[str]) -> Optional[str]:
    """Why these paths cannot be checkpointed together (None if they can): unknown, blocked or nested."""
    for p in paths:
        why = table.blocked(p)
        if why:
            return f"{p!r} cannot be checkpointed: {why}"
    for p in paths:
        for q in paths:
            if p != q and nested(p, q):
                return f"{p!r} lies inside {q!r}: checkpoint one or the other"
    return None


def calibrated(table: OpTable, forward_seconds: float) -> OpTable:
    """``table`` with its operators' seconds scaled so that they sum to ``forward_seconds`` (the measured
    forward: Note [Operator profiler] in swap.runtime.auto.op_profiler); unchanged if either sum is zero."""
    total = sum(op.seconds for op in table.ops)
    if total <= 0 or forward_seconds <= 0:
        return table
    k = forward_seconds / total
    return OpTable([replace(op, seconds=op.seconds * k) for op in table.ops], list(table.calls))
