"""The executor's copies: moving a variable's bytes off the device and back, waiting for them, and releasing
device copies. The executor holds one ``Transfers`` and says which variable moves when.

Note [Host block reuse]
Every iteration saves variables of the same sizes again. A dead variable's host block is kept by size and
handed to the next variable of that size, so the steady state never searches the host pool's free lists.
A spare block no variable took during a whole iteration goes back to the pool (``new_iteration``), where
best fit and coalescing serve any size: with shapes that change between iterations (a padding collator,
variable image sizes) spare blocks would otherwise pile up by exact size, one iteration's swapped bytes per
shape ever seen, all page-locked.

Note [Host block fences]
A host block's ``fence`` is the ticket of the last copy that read or wrote it. Every copy that uses the
block waits for that ticket on the device (``after``: Note [Device-side waits] in swap/runtime/machine/engines.py)
and becomes the new fence, so a block reused for another variable is not overwritten while a copy to the
device still reads it, whatever streams the model runs on. A block goes back to the pool only once its
fence is done: the pool may hand it to anyone.

Note [Releases without host waits]
Dropping a device copy whose copy to host (or back) may still run needs only that any later reuse of the
memory comes after the copy on the compute stream: ``wait_compute``, a device-side wait (Note [Device-side
waits]). So ``release``, ``process_dying`` and unpacks outside the plan never make the host wait, and
``stall_seconds`` counts only what the host really waited (on a CPU run, where the compute "stream" is the
host, that is every wait). A saved tensor changed in place before its release is caught by
``check_versions``; one changed after it is queued behind the copy by the same wait.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

from ..machine.host_pool import HostBlock, HostPool
from .clean import CleanVariable
from .lifecycle import Counters
from .tracer import Variable


class Transfers:
    """Copies and releases over ``engine`` (swap.runtime.machine.engines), host copies in ``pool``.

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
        # bytes -> host blocks of dead variables, for reuse (Note [Host block reuse]): those that became spare
        # during this iteration, and those left from the iteration before (back to the pool at the next one).
        self._spare_host: dict[int, list[HostBlock]] = {}
        self._stale_host: dict[int, list[HostBlock]] = {}

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

    def _host_block(self, nbytes: int) -> HostBlock:
        with self.counts:
            for spare in (self._spare_host, self._stale_host):
                blocks = spare.get(nbytes)
                if blocks:
                    return blocks.pop()
        return self.pool.alloc(nbytes)

    @property
    def spare_host_bytes(self) -> int:
        """Bytes of host blocks kept for reuse by size (Note [Host block reuse])."""
        with self.counts:
            return sum(b.size for spare in (self._spare_host, self._stale_host) for bs in spare.values() for b in bs)

    def new_iteration(self) -> None:
        """An iteration begins: spare blocks no variable took during the last one go back to the pool (Note
        [Host block reuse]), each once no copy uses it any more (Note [Host block fences])."""
        with self.counts:
            stale, self._stale_host, self._spare_host = self._stale_host, self._spare_host, {}
        for blocks in stale.values():
            for block in blocks:
                if block.fence is None or self.engine.done(block.fence):
                    block.fence = None
                    self.pool.free(block)
                else:
                    with self.counts:
                        self._stale_host.setdefault(block.nbytes, []).append(block)

    def _copy(self, direction: Callable[..., Any], block: HostBlock, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """A copy to or from ``block``, after the block's last copy (Note [Host block fences])."""
        ticket = direction(dst, src, after=block.fence)
        block.fence = ticket
        return ticket

    # -- copies -----------------------------------------------------------------------------------------
    def swap_out(self, var: Variable, i: Optional[int]) -> None:
        if var.host is None and var.dev is not None and var.alive:
            block = self._host_block(var.nbytes)
            var.set_host(block, self.pool.free)
            var.d2h = self._copy(self.engine.d2h, block, block.view, var.dev)
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
        # Note [Releases without host waits]
        if var.d2h is not None:
            self.counters.stall_seconds += self.engine.wait_compute(var.d2h)
            var.d2h = None
            var.check_versions()
        if var.h2d is not None:  # fetched but not used: the copy must finish before the memory is reused
            self.counters.stall_seconds += self.engine.wait_compute(var.h2d)
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
            var.d2h = None  # the copy back follows it on the device (Note [Host block fences])
            flat = self._new_copy(var)
            var.h2d = self._copy(self.engine.h2d, var.host, flat, var.host.view)
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
            self.counters.stall_seconds += self.engine.wait_compute(var.d2h)  # the copy below is on this stream
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
        """Releases the dead variables whose copies were in flight: the compute stream waits for those copies
        (Note [Releases without host waits]); their host blocks keep the copies as fences."""
        while self._dying:
            var = self._dying.pop()
            for ticket in (var.d2h, var.h2d):
                if ticket is not None and not self.closed:
                    self.counters.stall_seconds += self.engine.wait_compute(ticket)
            var.d2h = var.h2d = None
            var.dev = None
            self._recycle_host(var)

    def close(self) -> None:
        """No more copies: spare host blocks go back to the pool, and later dead variables' blocks too."""
        self.closed = True
        for spare in (self._spare_host, self._stale_host):
            for blocks in spare.values():
                for block in blocks:
                    block.fence = None  # the engine was drained
                    self.pool.free(block)
        self._spare_host, self._stale_host = {}, {}
