"""The profiling recorder: what one profiled iteration measured, turned into a ``Sequence``.

At each access the executor closes the step before it (``close_step``: the highest memory measured since,
which becomes that step's ``nonswap`` once our variables are taken out) and opens the next (``open_step``:
the variable, what is on the device that belongs to variables of this iteration, what is live now). In
between, callbacks note when a variable dies (``freed``) and when the forward lets go of a saved tensor we
released (``held_until``).

Note [A fetched copy held past its node]
A use's tensor is normally held by the backward node that unpacked it, until the node has run (``node_last``
from node groups). Something else may hold it longer: a checkpoint's frame keeps the region inputs it
unpacked for its rerun until the nodes that saved them have run (swap.joint.regions, Note [Recompute
regions]). Releasing our copy earlier frees nothing, so the profile records when the copy fetched for a use
actually died and extends that use's ``node_last`` to it: the scheduler then keeps the bytes counted (and
plans no release) until then.

Note [What a step's nonswap leaves out]
Every live variable of the iteration whose bytes are on the device is left out of ``nonswap``: the ones we
hold, and the ones the forward pass still holds after we released them (a residual input). The scheduler
adds them back: the first as resident, the second as not releasable until ``held_until``. A variable whose
storage outlives the iteration (the user holds it) cannot be freed by swapping at all: it is marked not
swappable and its bytes go back into ``nonswap`` for the steps it was alive.
"""

from __future__ import annotations

from typing import Any, Optional

from ...schedule.sequence import SAVE, Sequence


class Recorder:
    def __init__(self, first_live: int, first_size: int) -> None:
        self.var: list[int] = []
        self.kind: list[str] = []
        self.peak: list[int] = []  # per step: highest memory until the next access
        self.counted: list[int] = []  # per step: bytes of this iteration's variables on the device
        self.live: list[int] = []  # per step: memory live right after the access
        self.kept: list[int] = []
        self.node: list[int] = []  # per step: which backward node made the use (-1 for a save)
        self.saved_before: list[int] = []  # per step: tensors the iteration saved by then, ours or not
        self.marks: list[Any] = []  # timer marks, resolved at finish
        self.freed: dict[int, int] = {}
        self.held_until: dict[int, int] = {}
        self.first_live = first_live  # memory live at the iteration's first access
        self.base = max(0, first_live - first_size)
        self.overruns: list[tuple[int, int]] = []  # (step, measured) above the budget
        self._dying = 0  # bytes of held tensors freed in the open step
        self.unheld: list[int] = []  # per step: bytes put back into nonswap (Note [A held tensor freed mid-step])
        self.copy_held: dict[int, int] = {}  # use step -> step at which the copy fetched for it died

    def copy_died(self, use_step: int, now: int) -> None:
        """Note [A fetched copy held past its node]: the copy fetched for the use at ``use_step`` died at ``now``."""
        if 0 <= use_step < len(self.kind) and self.kind[use_step] != "save":
            self.copy_held[use_step] = max(self.copy_held.get(use_step, 0), now)

    def __len__(self) -> int:
        return len(self.var)

    def close_step(self, peak: int, held_peak: Optional[int], mark: Any) -> None:
        """``held_peak``: the step's peak with the held tensors freed in it counted from then on (None: not
        measured; all of them are then added to the peak, an upper bound)."""
        if len(self.peak) < len(self.var):
            self.peak.append(peak)
            self.marks.append(mark)
            self.unheld.append(max(0, held_peak - peak) if held_peak is not None else self._dying)
            self._dying = 0

    def held_freed(self, nbytes: int) -> None:
        """The forward let go of a saved tensor we had released, during the open step."""
        if len(self.peak) < len(self.var):
            self._dying += nbytes

    def open_step(self, var: int, kind: str, counted: int, live: int, kept: int, node: int = -1,
                  saved_before: int = 0) -> None:  # fmt: skip
        self.node.append(node)
        self.saved_before.append(saved_before)
        self.var.append(var)
        self.kind.append(kind)
        self.counted.append(counted)
        self.live.append(live)
        self.kept.append(kept)

    def finish(self, sizes: list[int], modules: list[str], resolve: Any,
               clean: Optional[list[bool]] = None) -> Optional[Sequence]:  # fmt: skip
        """The sequence this iteration recorded, or None if it recorded no access. ``clean``: per variable, a
        bucket of weights (Note [Clean variables at run time] in swap.runtime.activations.clean)."""
        n = len(self.var)
        if n == 0:
            return None
        if len(self.peak) < n:  # the iteration ended without closing its last step (an exception)
            return None
        freed = [min(n, self.freed.get(v, n)) for v in range(len(sizes))]
        # Swappable: the forward's storage died while the variable lived (Note [What a step's nonswap leaves out]).
        swappable = [v in self.held_until and self.held_until[v] <= freed[v] for v in range(len(sizes))]
        held_until = [min(self.held_until.get(v, n), n) if swappable[v] else 0 for v in range(len(sizes))]
        back = [0] * (n + 1)  # not swappable: their bytes go back into nonswap while they were counted
        first: dict[int, int] = {}
        for i, v in enumerate(self.var):
            first.setdefault(v, i)
        for v, f in first.items():
            if not swappable[v]:
                back[f] += sizes[v]
                back[max(f + 1, freed[v])] -= sizes[v]
        nonswap, transient, cur = [], [], 0
        for i in range(n):
            cur += back[i]
            nonswap.append(max(0, self.peak[i] - self.counted[i] + cur + self.unheld[i]))
            transient.append(max(0, self.peak[i] - self.live[i]))
        compute = [resolve(m) for m in self.marks]
        node_last = list(range(n))
        for i in range(n - 2, -1, -1):
            if self.node[i] >= 0 and self.node[i + 1] == self.node[i]:
                node_last[i] = node_last[i + 1]
        for i, died in self.copy_held.items():  # Note [A fetched copy held past its node]
            node_last[i] = max(node_last[i], min(n - 1, died - 1))
        return Sequence(
            list(self.var), list(self.kind), list(sizes), nonswap, compute, swappable, held_until,
            freed=freed, modules=list(modules), transient=transient, kept=list(self.kept), base=self.base,
            node_last=node_last, clean=list(clean) if clean else [], saved_before=list(self.saved_before),
        )  # fmt: skip


def describe_step(i: int, tail: bool, var_ids: list[int], kinds: list[str], modules: list[str],
                  seq: Optional[Sequence]) -> str:  # fmt: skip
    """Where step ``i`` is, for a warning: the phase and the module of its variable (``modules``: this
    iteration's, by variable; else ``seq``'s); ``tail``: the iteration's last interval."""
    if i >= len(var_ids):
        return "after the last saved tensor"
    v = var_ids[i]
    module = modules[v] if v < len(modules) else ""
    if not module and seq is not None and seq.modules and v < len(seq.modules):
        module = seq.modules[v]
    phase = "forward" if kinds[i] == SAVE else "backward"
    if tail:
        return f"after the backward of {module or 'the model'} (the rest of backward, the optimizer step)"
    return f"in the {phase} of {module or 'the model'}"
