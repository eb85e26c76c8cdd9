"""The executor's copies: moving a variable's bytes off the device and back, waiting for them, and releasing
device copies. The executor holds one ``Transfers`` and says which variable moves when.

Note [Host block reuse]
Every iteration saves variables of the same sizes again. A dead variable's host block is kept by size and
handed to the next variable of that size, so the steady state never searches the host pool's free lists.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

from .clean import CleanVariable
from .host_pool import HostPool
from .lifecycle import Counters
from .tracer import Variable


class Transfers:
    """Copies and releases over ``engine`` (swap.runtime.engines), host copies in ``pool``.

    ``counts`` is the executor's lock for byte counts that callbacks change (never held while waiting);
    ``on_copy(var)`` is called before device memory is made for a copy of ``var`` coming back; ``log(i, action,
    var)`` records what step ``i`` issued."""

    def __init__(self, device: torch.device, engine: Any, pool: HostPool, counters: Counters,
                 counts: threading.RLock, on_copy: Callable[[Variable], None],
                 log: Callable[[int, str, Variable], None]) -> None:  # fmt: skip
        self.device = device
        self.engine = engine
        self.pool = pool
        self.counters = counters
        self.counts = counts
        self.on_copy = on_copy
        self.log = log
        self.closed = False
        self._dying: list[Variable] = []  # dead variables whose copies were still in flight
        self._spare_host: dict[int, list[Any]] = {}  # bytes -> host blocks of dead variables, for reuse

    # -- host blocks ------------------------------------------------------------------------------------
    def _recycle_host(self, var: Variable) -> None:
        """A dead variable's host block goes to the next iteration's variable of that size (Note [Host block
        reuse]); after close, to the pool."""
        if var.host is None:
            return
        if self.closed:
            var.free_host()
            return
        block = var.take_host()
        with self.counts:
            self._spare_host.setdefault(block.nbytes, []).append(block)

    def _host_block(self, nbytes: int) -> Any:
        with self.counts:
            spare = self._spare_host.get(nbytes)
            if spare:
                return spare.pop()
        return self.pool.alloc(nbytes)

    # -- copies -----------------------------------------------------------------------------------------
    def swap_out(self, var: Variable, i: Optional[int]) -> None:
        if var.host is None and var.dev is not None and var.alive:
            var.set_host(self._host_block(var.nbytes), self.pool.free)
            var.d2h = self.engine.d2h(var.host.view, var.dev)
            self.counters.swapped_out_bytes += var.nbytes
        if i is not None:
            self.log(i, "swap_out", var)

    def release(self, var: Variable, i: Optional[int] = None) -> None:
        if var.dev is None:
            return
        if isinstance(var, CleanVariable):  # weights: dropped, no copy out (Note [Clean variables at run time])
            var.mover.drop(var.key)
            if i is not None:
                self.log(i, "release", var)
            return
        if var.host is None and var.alive:
            self.swap_out(var, None)  # never dropped without a copy while autograd may still ask for it
        if var.d2h is not None:
            self.counters.stall_seconds += self.engine.wait_host(var.d2h)
            var.d2h = None
            var.check_versions()
        if var.h2d is not None:  # fetched but not used: the copy must finish before the memory goes
            self.counters.stall_seconds += self.engine.wait_host(var.h2d)
            var.h2d = None
        var.dev = None
        if i is not None:
            self.log(i, "release", var)

    def swap_in(self, var: Variable, i: int) -> None:
        if var.dev is not None or not var.alive:
            return
        if isinstance(var, CleanVariable):  # weights: fetched from their host master by their mover
            var.mover.fetch(var.key, prefetch=True)
            self.log(i, "swap_in", var)
            return
        original = var.original()
        if original is not None and var.unchanged():
            var.attach(original)  # still alive elsewhere: a copy would only add memory
        elif var.host is not None:
            if var.d2h is not None:  # released without a wait (evicted): its copy must be complete
                self.counters.stall_seconds += self.engine.wait_host(var.d2h)
                var.d2h = None
            flat = self._new_copy(var)
            var.h2d = self.engine.h2d(flat, var.host.view)
            self.counters.swapped_in_bytes += var.nbytes
        else:
            raise RuntimeError(f"swap: internal error: variable {var.id} has neither a device nor a host copy")
        self.log(i, "swap_in", var)

    def _new_copy(self, var: Variable) -> torch.Tensor:
        """Device memory for ``var``'s bytes to come back into (a run without swapping would hold them)."""
        self.on_copy(var)
        flat = torch.empty(var.nbytes, dtype=torch.uint8, device=self.device)
        var.adopt_copy(flat)
        return flat

    def ensure_resident(self, var: Variable, i: int) -> None:
        if isinstance(var, CleanVariable):
            if var.dev is None:
                self.counters.demand_fetches += 1
                self.log(i, "demand", var)
                var.mover.fetch(var.key, prefetch=False)
            self.counters.stall_seconds += var.mover.ready(var.key)
            return
        if var.dev is None:
            original = var.original()
            if original is None or not var.unchanged():
                self.counters.demand_fetches += 1
                self.log(i, "demand", var)
            self.swap_in(var, i)
        if var.h2d is not None:
            self.counters.stall_seconds += self.engine.wait_compute(var.h2d)
            var.h2d = None
        if not var.dev_is_copy and var.versions:
            var.check_versions("after it was saved, and the modified storage is what backward would read")

    def fetch_outside(self, var: Variable) -> torch.Tensor:
        """A synchronous copy back, for unpacks outside the plan (a graph of an earlier iteration, after exit)."""
        if var.dev is not None:
            if var.h2d is not None and not self.closed:
                self.engine.wait_compute(var.h2d)
                var.h2d = None
            return var.dev
        original = var.original()
        if original is not None and var.unchanged():
            var.attach(original)
            flat, var.dev = var.dev, None  # not held: autograd's view keeps it for the node that asked
            return flat
        if var.d2h is not None and not self.closed:
            self.engine.wait_host(var.d2h)
            var.d2h = None
        if var.host is None:
            raise RuntimeError(f"swap: internal error: variable {var.id} has neither a device nor a host copy")
        if self.closed:
            return var.host.view.to(self.device, copy=True)
        flat = self._new_copy(var)
        flat.copy_(var.host.view)
        var.dev = None  # not held: autograd's view keeps it for the node that asked
        return flat

    # -- dead variables ---------------------------------------------------------------------------------
    def retire(self, var: Variable) -> None:
        """``var`` died: its memory goes now, or at the next step if a copy still reads or writes it."""
        if var.d2h is not None and self.engine.done(var.d2h):
            var.d2h = None  # long done (kept resident since): no wait
        if var.d2h is not None or var.h2d is not None:
            self._dying.append(var)  # a copy still reads or writes its memory: released at the next step
        else:
            var.dev = None
            self._recycle_host(var)

    def process_dying(self) -> None:
        """Releases the dead variables whose copies were in flight (waiting for those copies)."""
        while self._dying:
            var = self._dying.pop()
            for ticket in (var.d2h, var.h2d):
                if ticket is not None and not self.closed:
                    self.engine.wait_host(ticket)
            var.d2h = var.h2d = None
            var.dev = None
            self._recycle_host(var)

    def close(self) -> None:
        """No more copies: spare host blocks go back to the pool, and later dead variables' blocks too."""
        self.closed = True
        for blocks in self._spare_host.values():
            for block in blocks:
                self.pool.free(block)
        self._spare_host = {}
