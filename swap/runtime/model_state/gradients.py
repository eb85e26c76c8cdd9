"""Gradients of offloaded parameters: copied off the device as autograd makes them, accumulated on the host.

Note [Gradients on the host]
A post-accumulate-grad hook on each managed parameter takes ``p.grad`` the moment autograd has made it, starts its
copy to the parameter's host gradient buffer on the D2H lane, and sets ``p.grad = None``: the device memory goes
once the copy has landed, and the user's optimizer skips the parameter (it steps only those with a gradient). The
first backward pass of an optimizer step copies; a later one (gradient accumulation) copies to a staging buffer (a
pool of a fixed, predicted size: a copy waits for earlier adds when it is full) and adds it to the host buffer,
the same IEEE addition in the same order as autograd's ``grad += new``, so the result is bitwise plain torch's.
``zero_grad`` resets the host buffers as it would ``p.grad``: ``set_to_none`` forgets them (the next backward
copies), otherwise they are zeroed (the next one adds to zero, as torch does). Without a ``zero_grad`` gradients
accumulate across steps, as in torch. The host work runs on the host-step worker, in order with the host steps
that read the buffers (one thread, first in first out); a new copy into a buffer waits for any earlier work on it
and for the pending host step of its bucket.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch

from ..host_pool import HostBlock, HostPool, HostPoolExhausted
from .buckets import Entry, trains
from .storage import Copies, grad_span, host_tensor


class GradSink:
    """The host gradient buffers of ``entries``' parameters (from ``pool``; accumulation staging from ``staging``),
    filled over ``engine`` with the host work on ``worker``. ``gate(entry)`` waits for the pending host step of the
    entry's bucket; ``in_backward()`` is told when a gradient arrives (a backward pass runs)."""

    def __init__(self, entries: list[Entry], pool: HostPool, staging: HostPool, engine: Any,
                 worker: ThreadPoolExecutor, gate: Callable[[int], None], in_backward: Callable[[], None],
                 copies: Copies, busy: Callable[[], Any]) -> None:  # fmt: skip
        self.pool, self.staging, self.engine, self.worker = pool, staging, engine, worker
        self.gate, self.in_backward, self.copies, self.busy = gate, in_backward, copies, busy
        self.lock = threading.Lock()
        # Frozen parameters have no gradient buffer (Note [Frozen parameters] in swap.runtime.model_state.buckets).
        self.params = [p for e in entries for _, p in e.params if trains(p)]
        self.offloaded = {id(p) for p in self.params}  # whose gradients leave the device (not resident ones)
        self.entry_of = {id(p): e.index for e in entries for _, p in e.params}
        self.blocks: dict[int, HostBlock] = {}
        self.host: dict[int, torch.Tensor] = {}  # id(p) -> host gradient buffer
        self.has: dict[int, bool] = {}  # id(p) -> the buffer holds this step's gradient so far
        self.tasks: dict[int, Future] = {}  # id(p) -> the last host work on its buffer
        self._handles: list[Any] = []

    def allocate(self) -> None:
        for p in self.params:
            self.blocks[id(p)] = block = self.pool.alloc(grad_span(p))
            self.host[id(p)] = host_tensor(block.view, p, 0)
            self.has[id(p)] = False

    def host_bytes(self) -> int:
        return sum(b.size for b in self.blocks.values())

    def install(self) -> None:
        for p in self.params:
            self._handles.append(p.register_post_accumulate_grad_hook(self._arrived))
            if p.grad is not None:  # made before the manager started: it moves to the host too
                self.take(p)

    def uninstall(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- gradients arriving -----------------------------------------------------------------------------
    def _arrived(self, p: torch.nn.Parameter) -> None:
        self.in_backward()
        if id(p) in self.offloaded:
            self.take(p)

    def take(self, p: torch.nn.Parameter) -> None:
        """Note [Gradients on the host]."""
        g = p.grad
        if g is None:
            return
        p.grad = None
        k = id(p)
        self.gate(self.entry_of[k])
        with self.lock, self.busy():
            host = self.host[k]
            earlier = self.tasks.get(k)
            if self.has[k]:
                block = self._staging_block(grad_span(p))
                staged = host_tensor(block.view, p, 0)
                ticket = self.engine.d2h(staged, g)
                self.tasks[k] = self.worker.submit(self._add, ticket, g, host, staged, block)
            else:
                if earlier is not None:
                    earlier.result()  # nothing else may be writing the buffer
                ticket = self.engine.d2h(host, g)
                self.tasks[k] = self.worker.submit(self._landed, ticket, g)
                self.has[k] = True
            self.copies.grads_out += g.numel() * g.element_size()

    def _staging_block(self, nbytes: int) -> HostBlock:
        """A staging buffer, within the staging pool's predicted size: when it is full, the adds in flight finish
        and free theirs first (Note [Host memory before allocating])."""
        try:
            return self.staging.alloc(nbytes)
        except HostPoolExhausted:
            for t in list(self.tasks.values()):
                t.result()
            return self.staging.alloc(nbytes)

    def _landed(self, ticket: Any, g: torch.Tensor) -> None:
        self.engine.wait_host(ticket)
        del g  # the device memory goes only once the copy has read it (Note [Copies without record_stream])

    def _add(self, ticket: Any, g: torch.Tensor, host: torch.Tensor, staged: torch.Tensor, block: HostBlock) -> None:
        self.engine.wait_host(ticket)
        del g
        host.add_(staged)
        self.staging.free(block)

    # -- reading and resetting ------------------------------------------------------------------------------
    def settle(self) -> None:
        """Waits until every gradient that has arrived is in its host buffer."""
        with self.lock:
            tasks = list(self.tasks.values())
        for t in tasks:
            t.result()

    def grad(self, p: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """``p``'s host gradient (call ``settle`` first), or None if it has none this step."""
        return self.host[id(p)] if self.has.get(id(p)) else None

    def manages(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient lives in a host buffer (an offloaded parameter's)."""
        return id(p) in self.offloaded

    def to_device(self, p: torch.nn.Parameter, device: torch.device) -> int:
        """``p`` becomes resident: its host gradient (if any) becomes ``p.grad`` again, made on ``device`` where
        the meter sees it; returns the bytes copied in."""
        self.settle()
        self.offloaded.discard(id(p))
        g = self.grad(p)
        self.has[id(p)] = False
        if g is None:
            return 0
        with torch.no_grad():
            p.grad = g.to(device, copy=True)
        return g.numel() * g.element_size()

    def zero(self, params: Any, set_to_none: bool) -> None:
        """``zero_grad`` for the managed ones of ``params`` (Note [Gradients on the host])."""
        with self.lock:
            for p in params:
                k = id(p)
                if k not in self.offloaded or not self.has[k]:
                    continue
                if set_to_none:
                    self.has[k] = False
                else:
                    self.tasks[k] = self.worker.submit(self.host[k].zero_)

    def close(self) -> None:
        self.settle()
        for block in self.blocks.values():
            self.pool.free(block)
        self.blocks, self.host = {}, {}
