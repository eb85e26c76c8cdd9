"""The executor's copies: moving a variable's bytes off the device and back, waiting for them, and evicting
for the allocator.

Note [Host block reuse]
Every iteration saves variables of the same sizes again. A dead variable's host block is kept by size and
handed to the next variable of that size, so the steady state never searches the host pool's free lists.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .tracer import Variable


class Transfers:
    """Copies and releases of ``Executor`` (a mixin: it runs on the executor's own state)."""

    def _log(self, i: int, action: str, var: Variable) -> None:
        self.actions.append((i, action, var.id))

    def _recycle_host(self, var: Variable) -> None:
        """A dead variable's host block goes to the next iteration's variable of that size (Note [Host block
        reuse]); after close, to the pool."""
        if var.host is None:
            return
        if self.closed:
            var.free_host()
            return
        block = var.take_host()
        with self._acct:
            self._spare_host.setdefault(block.nbytes, []).append(block)

    def _host_block(self, nbytes: int) -> Any:
        with self._acct:
            spare = self._spare_host.get(nbytes)
            if spare:
                return spare.pop()
        return self.pool.alloc(nbytes)

    def _swap_out(self, var: Variable, i: Optional[int]) -> None:
        if var.host is None and var.dev is not None and var.alive:
            var.set_host(self._host_block(var.nbytes), self.pool.free)
            var.d2h = self.engine.d2h(var.host.view, var.dev)
            self.counters.swapped_out_bytes += var.nbytes
        if i is not None:
            self._log(i, "swap_out", var)

    def _release(self, var: Variable, i: Optional[int] = None) -> None:
        if var.dev is None:
            return
        if var.host is None and var.alive:
            self._swap_out(var, None)  # never dropped without a copy while autograd may still ask for it
        if var.d2h is not None:
            self.counters.stall_seconds += self.engine.wait_host(var.d2h)
            var.d2h = None
            var.check_versions()
        if var.h2d is not None:  # fetched but not used: the copy must finish before the memory goes
            self.counters.stall_seconds += self.engine.wait_host(var.h2d)
            var.h2d = None
        var.dev = None
        if i is not None:
            self._log(i, "release", var)

    def _swap_in(self, var: Variable, i: int) -> None:
        if var.dev is not None or not var.alive:
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
        self._log(i, "swap_in", var)

    def _new_copy(self, var: Variable) -> torch.Tensor:
        """Device memory for ``var``'s bytes to come back into (a run without swapping would hold them)."""
        if not var.on_device:
            self.memory.add_shadow(-var.nbytes)
            with self._acct:
                var.on_device = True
                if var.alive and var.iteration == self.iteration:
                    self._on_device_bytes += var.nbytes
        flat = torch.empty(var.nbytes, dtype=torch.uint8, device=self.device)
        var.adopt_copy(flat)
        return flat

    def _ensure_resident(self, var: Variable, i: int) -> None:
        if var.dev is None:
            original = var.original()
            if original is None or not var.unchanged():
                self.counters.demand_fetches += 1
                self._log(i, "demand", var)
            self._swap_in(var, i)
        if var.h2d is not None:
            self.counters.stall_seconds += self.engine.wait_compute(var.h2d)
            var.h2d = None
        if not var.dev_is_copy and var.versions:
            var.check_versions("after it was saved, and the modified storage is what backward would read")

    def _fetch_outside(self, var: Variable) -> torch.Tensor:
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

    def evict(self, nbytes: int) -> bool:
        """Frees device copies of resident variables, least recently used first (copying those that have no
        host copy yet, synchronously), until ``nbytes`` are freed. True if anything was evicted."""
        with self.lock:
            if self.closed:
                return False
            current = self.step - 1
            victims = sorted(
                (v for v in self.vars if v.dev is not None and v.last_access < current and v.h2d is None),
                key=lambda v: v.last_access,
            )
            freed = 0
            for v in victims:
                if freed >= nbytes:
                    break
                self._release(v)
                freed += v.nbytes
                self.counters.evictions += 1
            return freed > 0

    def _process_dying(self) -> None:
        while self._dying:
            var = self._dying.pop()
            for ticket in (var.d2h, var.h2d):
                if ticket is not None and not self.closed:
                    self.engine.wait_host(ticket)
            var.d2h = var.h2d = None
            var.dev = None
            self._recycle_host(var)
