"""The scheduler's prefetch queue: the uses whose swap-in is due, kept incrementally. Pure: no torch, no I/O.

Note [An incremental prefetch queue]
At every step the scheduler's prefetch pass walks the wanted uses (due, not yet reached) nearest first: a use
whose variable is resident has its reserved swap-out cancelled, one whose variable is off the device with a
host copy is fetched while room can be made, and the first that does not fit ends the pass. Sorting and
walking every wanted use at every step made the window sweep of the joint search quadratic in the window's
length (2.9 M passes, most of them cancelling nothing and fetching nothing, for a 22-layer model).

The pass does the same with two lazy heaps of use steps, so that it touches only uses that can act:

- ``fetchable``: every wanted use whose variable is off the device with a host copy is in it. A variable gets
  there only by being dropped from the device (its host copy exists or is made just before the drop), and
  a use only by being triggered, so both push; an entry found stale (fetched, or the variable back on the
  device) is discarded, as the next drop pushes it again.
- ``cancellable``: every wanted use whose variable has a reserved swap-out is in it; a reservation and a
  trigger push, a stale entry is discarded.

Uses are triggered nearest first (every policy triggers a use step at most once, in increasing order), so
the wanted uses at step i are exactly the triggered use steps in (i, reached]; a variable's ones are found
by bisection among its own use steps. Cancelling before or after the fetches of the same pass is the same:
a wanted variable is kept by ``_make_room``, and only the cancellations before the first use that does not
fit happen, as in the walk. tests/swap/test_scheduler_equivalence.py holds the walk itself and checks both
give the same schedule.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right

from .sequence import SAVE, Sequence


class Wanted:
    """The wanted uses of a planning pass (Note [An incremental prefetch queue])."""

    def __init__(self, seq: Sequence) -> None:
        self.var = seq.var
        self.swappable = seq.swappable
        self.uses: dict[int, list[int]] = {}  # swappable variable -> its use steps, ascending
        for u, (v, k) in enumerate(zip(seq.var, seq.kind)):
            if k != SAVE and seq.swappable[v]:
                self.uses.setdefault(v, []).append(u)
        self.order: list[int] = []  # triggered use steps, ascending
        self.head = 0  # order[head:] are the ones not reached yet
        self.count: dict[int, int] = {}  # variable -> wanted uses of it (the prefetch pass keeps these)
        self.reached = -1  # the last triggered use step
        self.fetchable: list[int] = []
        self.cancellable: list[int] = []

    def trigger(self, u: int, pending: dict[int, int]) -> None:
        """Use step u's prefetch is due; ``pending``: the reserved swap-outs."""
        self.reached = u
        v = self.var[u]
        if not self.swappable[v]:
            return
        self.order.append(u)
        self.count[v] = self.count.get(v, 0) + 1
        heapq.heappush(self.fetchable, u)
        if v in pending:
            heapq.heappush(self.cancellable, u)

    def expire(self, i: int) -> None:
        """Step i is reached: its use and earlier ones are no longer wanted."""
        order, count = self.order, self.count
        while self.head < len(order) and order[self.head] <= i:
            v = self.var[order[self.head]]
            count[v] -= 1
            if not count[v]:
                del count[v]
            self.head += 1

    def _of(self, v: int, i: int) -> list[int]:
        """Variable v's wanted use steps after step i."""
        uses = self.uses.get(v)
        if not uses or v not in self.count:
            return []
        return uses[bisect_right(uses, i):bisect_right(uses, self.reached)]

    def dropped(self, v: int, i: int) -> None:
        """Variable v left the device at step i, with a host copy."""
        for u in self._of(v, i):
            heapq.heappush(self.fetchable, u)

    def reserved(self, v: int, i: int) -> None:
        """Variable v's swap-out was reserved at step i."""
        for u in self._of(v, i):
            heapq.heappush(self.cancellable, u)
