"""Plans kept by input shape, so that a run whose batches change shape (a padding collator, a bucketing sampler,
images of several sizes) profiles each shape at most once, and most shapes never.

Note [Plans by input shape]
A plan (the profiled sequence and its schedule, or the decision not to swap) holds for iterations that repeat
the profiled one step for step. With dynamic shapes the next iteration rarely does, and profiling every change
would profile most iterations, each under the conservative plan. So plans are kept per *shape key*: the shape
and dtype of the first tensor the iteration saves (the model's input, or the first thing computed from it). At
an iteration's start the lifecycle looks its key up:

1. a plan made for this key is reused as it is;
2. else the plan of the nearest *larger* key (same rank and dtype, no dimension smaller; the fewest elements
   of those), if the shape it was profiled at has at most ``DERIVE_RATIO`` times this key's elements, is
   used as a derived plan: the sizes it was planned with are upper bounds, and a step matches it
   when its kind and variable are those of the plan, its bytes are no more than the plan's, and the iteration
   has saved as many tensors by then, ours or not (``Sequence.saved_before``: sizes alone would let a tensor
   that fell under ``min_bytes`` shift the next one onto its variable). A plan that
   keeps the budget for a larger input keeps it for a smaller one whose steps map onto it in order: every
   variable and every step's unswappable bytes are no larger, and the same variables are on the device at
   each step. Variables map by save order, so the step structure must be the same: where it is not (a saved
   tensor falls below ``min_bytes`` at the smaller shape, control flow on the shape), the derived plan
   diverges at the first step that differs, the iteration finishes under the conservative plan, and that key
   is profiled on its own the next time it comes (never derived again). After its first iteration the derived
   plan is planned again (no profiling: the scheduler only) on the sizes that iteration's variables had, with
   the larger shape's unswappable bytes still as bounds: it then swaps no more than this shape needs, for the
   memory the larger shape measured. Those bounds are why derivation stops at ``DERIVE_RATIO``: a plan from a
   much larger shape counts that shape's working memory at every step, so an input a quarter the size swaps
   as if it were large, though it may fit unswapped; such a shape is profiled on its own once, and then
   serves the shapes below it. A run *declined* at a larger key (it fit the budget unswapped) serves every
   smaller key, whatever the ratio: with no plan there are no bounds to overstate, and a smaller input of the
   same structure needs no more memory (were it to need more, the declined run's check at each backward,
   ``Lifecycle.declined_backward``, warns and profiles it);
3. else the iteration is profiled (one profiling iteration: the optimizer's state already exists) and its
   plan kept under its key.

A larger key's plan, not the nearest smaller one scaled up, because only the first is safe without a model of
how each variable grows: derivation from a scaled trace (Note [Linear traces] in swap.capture.scaling) needs
two profiles of every structure and a length the runtime does not see. The cost is speed, not memory: a
smaller input under a larger one's plan may swap more than it must. Measured in bench/dynamic_shapes.py.

Note [A plan's variables, whatever their size]
``min_bytes`` decides what a *profile* records as ours; it must not decide whether a later iteration matches
the plan. A saved tensor's size shrinks with the input, so a tensor of the larger shape's plan can fall under
``min_bytes`` at a smaller one (GPT-2's attention scores, quadratic in the length, cross 1 MiB between lengths
88 and 96 at batch 8): it would then stay put, every later step of the plan would be shifted by one, and the
derived plan would diverge at that step (a fallback, a re-plan and a profile, at each length that crosses). So
a saved tensor under ``min_bytes`` that the followed plan expects at this point of the iteration (a save of a
new variable or of the one whose storage it shares, after as many saved tensors, ours or not:
``Executor.expects``) is taken as the plan's variable, and moved as the plan says. Only ``min_bytes`` yields:
a tensor skipped for another reason (a parameter, ``exclude``, expanded, another device) still stays put, and
the plan diverges as before. A plan profiled at its own shape never expects a tensor it did not record, so
nothing under ``min_bytes`` is taken there.

The key is read from the first saved tensor because the saved-tensor hooks see nothing earlier; a model whose
first saved tensor does not depend on the input's shape (a weight bucket streamed by model state) gets one
key for every shape, and each change of shape then re-profiles as before (a derived plan's mismatch is found
at the first step that differs, so the run stays correct either way). At most ``MAX_PLANS`` plans are kept,
the least recently used dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ...schedule.scheduler import Schedule
from ...schedule.sequence import Sequence

ShapeKey = tuple[str, tuple[int, ...]]  # (dtype, shape) of the iteration's first saved tensor
MAX_PLANS = 64
DERIVE_RATIO = 2  # a plan serves shapes down to 1/DERIVE_RATIO of the elements it was profiled at


def shape_key(t: torch.Tensor) -> ShapeKey:
    """The shape key of an iteration whose first saved tensor is ``t`` (Note [Plans by input shape])."""
    return str(t.dtype), tuple(t.shape)


@dataclass
class Entry:
    """A plan kept for one key: ``schedule`` None is a run declined at that shape (``sequence`` None: nothing
    to move there). ``bounds``: the sizes are a larger shape's (a derived plan), so they bound a step's bytes."""

    sequence: Optional[Sequence]
    schedule: Optional[Schedule]
    first_live: int  # memory live at the start of the iteration it was profiled on
    bounds: bool = False
    learned: set[int] = field(default_factory=set)
    source: Optional[ShapeKey] = None  # the key whose profile a derived plan's bounds come from (None: its own)


def _covers(big: ShapeKey, small: ShapeKey) -> bool:
    (dt_b, s_b), (dt_s, s_s) = big, small
    return dt_b == dt_s and len(s_b) == len(s_s) and all(b >= s for b, s in zip(s_b, s_s))


def _elements(key: ShapeKey) -> int:
    n = 1
    for d in key[1]:
        n *= d
    return n


class PlanBook:
    """The plans of a run by shape key (Note [Plans by input shape]), with what the report counts about them."""

    def __init__(self, limit: int = MAX_PLANS) -> None:
        self.limit = limit
        self.entries: OrderedDict[ShapeKey, Entry] = OrderedDict()
        self.own_profile: set[ShapeKey] = set()  # keys a derived plan did not fit: profiled on their own
        self.seen: set[ShapeKey] = set()
        self.reused = 0  # iterations that began on a kept plan of another shape than the iteration before
        self.derived = 0  # ... of which the plan was a larger shape's
        self.refined = 0  # derived plans re-planned on their own shape's sizes

    def find(self, key: ShapeKey) -> tuple[Optional[Entry], Optional[ShapeKey]]:
        """The plan for ``key`` and the key its bounds were profiled at: (its own, its ``source``); (a larger
        key's, the key that one was profiled at); or (None, None)."""
        own = self.entries.get(key)
        if own is not None:
            self.entries.move_to_end(key)
            return own, own.source
        if key in self.own_profile:
            return None, None
        near = _elements(key) * DERIVE_RATIO
        larger = [k for k, e in self.entries.items()
                  if _covers(k, key) and (e.schedule is None or _elements(e.source or k) <= near)]
        if not larger:
            return None, None
        best = min(larger, key=_elements)
        self.entries.move_to_end(best)
        return self.entries[best], self.entries[best].source or best

    def keep(self, key: ShapeKey, entry: Entry) -> None:
        self.entries[key] = entry
        self.entries.move_to_end(key)
        while len(self.entries) > self.limit:
            self.entries.popitem(last=False)

    def reject(self, key: Optional[ShapeKey], derived: bool) -> None:
        """The plan used for ``key`` did not match its iteration: forget it; a derived one is never tried for
        ``key`` again."""
        if key is None:
            return
        self.entries.pop(key, None)
        if derived:
            self.own_profile.add(key)

    def clear(self) -> None:
        """What the model saves changed (recompute regions applied): no kept plan holds."""
        self.entries.clear()
        self.own_profile.clear()

    def counts(self) -> dict[str, Any]:
        return {"shapes_seen": len(self.seen), "plans_kept": len(self.entries), "plans_reused": self.reused,
                "plans_derived": self.derived, "plans_refined": self.refined}  # fmt: skip
