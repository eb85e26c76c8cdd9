"""Host masters and device copies of the managed parameters' storages.

Note [Device copies by storage resize]
A streamed entry keeps its device storage object for the whole run and resizes it: to zero bytes when its weights
are dropped, back to full size when they are fetched (then filled from the host master). Parameters keep their
shape, dtype and identity, the optimizer's references stay valid, and every view of them (a ``weight.t()`` saved
for backward) sees the bytes once they are back. This is FSDP's proven trick; replacing ``p.data`` instead would
change the parameter's shape while dropped and leave saved views holding the old storage. The live-bytes meter
follows the resizes (Note [Storages that resize] in swap.runtime.machine.meter). A storage that cannot be resized
(memory another library owns) is replaced once, at the start, by a resizable copy.

A drop is *clean*: the host master is the truth, nothing is copied back, unless something wrote the device copy
since it was fetched (``dirty``: ``model.load_state_dict``, a user's in-place edit; the parameter guard sees the
write), in which case it is copied back first. What a drop does depends on the entry's placement (Note
[Model-state placements] in swap.schedule.model_state): a ``STREAMED`` entry's storage is freed; a
``HOST_MASTER`` entry keeps its device memory and is only marked stale (its next fetch refreshes it in place);
a ``RESIDENT`` entry is never dropped: its device copy is the truth.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...schedule.model_state import Placement
from ..machine.host_pool import HostBlock, HostPool
from .buckets import Entry, span_bytes


def host_tensor(block_view: torch.Tensor, like: torch.Tensor, storage_offset: int,
                dtype: Optional[torch.dtype] = None) -> torch.Tensor:  # fmt: skip
    """A host tensor with ``like``'s size and strides and its dtype (or ``dtype``), starting ``storage_offset``
    elements into the host block ``block_view`` (a uint8 view from the host pool, aligned for every dtype). Made
    with Python dispatch off: host memory is not the device's (Note [Host pool on CPU runs])."""
    dtype = dtype or like.dtype
    size = dtype.itemsize
    with _disable_current_modes():
        return torch.empty(0, dtype=dtype).set_(
            block_view.untyped_storage(), block_view.storage_offset() // size + storage_offset, like.size(),
            like.stride(),
        )  # fmt: skip


def flat(block_view: torch.Tensor, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of host block ``block_view`` as a 1-D tensor of ``dtype`` (dispatch off)."""
    with _disable_current_modes():
        return torch.empty(0, dtype=dtype).set_(block_view.untyped_storage(),
                                                block_view.storage_offset() // dtype.itemsize,
                                                (nbytes // dtype.itemsize,))  # fmt: skip


class Copies:
    """Byte counts of what crossed the link for model state (the report's per-kind counts)."""

    def __init__(self) -> None:
        self.weights_in = 0
        self.weights_out = 0
        self.grads_out = 0
        self.state_in = 0  # optimizer state (and gradients) brought to the device for a resident placement
        self.demand_fetches = 0
        self.stall_seconds = 0.0  # waiting for a fetch to land


class Masters:
    """The host master of every entry (from ``pool``) and the state of its device copy: ``current`` (it holds the
    weights now), ``allocated`` (it has its bytes), fetched with ``engine``, ``dirty``; ``placement`` per entry.
    ``busy()`` is a context in which the parameter guard lets our own operators through. ``compute``: the pool of
    the masters' copies in the compute dtype, for entries whose device copy has another dtype than the master
    (Note [Mixed precision] in swap.runtime.model_state.precision; None: no such entry). Thread-safe: the
    fetches and drops of a backward pass may run on autograd's device threads."""

    def __init__(self, entries: list[Entry], pool: HostPool, engine: Any, device: torch.device,
                 busy: Callable[[], Any], copies: Copies, compute: Optional[HostPool] = None) -> None:  # fmt: skip
        self.entries = entries
        self.pool = pool
        self.compute = compute
        self.cast: list[Optional[HostBlock]] = [None] * len(entries)  # the compute-dtype copy, per mixed entry
        self._cast_h2d: list[Any] = [None] * len(entries)  # the last copy that read it
        # Note [One cast per master change]: per mixed entry, changes counted, and what they and the masters'
        # version counters were when the copy was cast (None: never)
        self._changes = [0] * len(entries)
        self._cast_seen: list[Optional[tuple[int, tuple[int, ...]]]] = [None] * len(entries)
        self._hosts: list[Optional[list[torch.Tensor]]] = [None] * len(entries)  # host_param's tensors, per entry
        self.casts = 0  # casts made (a fetch whose copy was current makes none)
        self.engine = engine
        self.device = device
        self.busy = busy
        self.copies = copies
        self.lock = threading.RLock()
        self.blocks: list[Optional[HostBlock]] = [None] * len(entries)
        self.current = [True] * len(entries)
        self.allocated = [True] * len(entries)
        self.dirty = [False] * len(entries)
        self.h2d: list[Any] = [None] * len(entries)
        self._flat: list[Optional[torch.Tensor]] = [None] * len(entries)  # uint8 views over the device storages
        self.placement = [Placement.STREAMED] * len(entries)

    # -- setting up -------------------------------------------------------------------------------------
    def allocate(self) -> None:
        """A host master for every entry, filled from its device copy (which stays resident)."""
        for e in self.entries:
            if not self.mixed(e):
                self._ensure_resizable(e)
            self.blocks[e.index] = block = self.pool.alloc(e.master_nbytes)
            with _disable_current_modes():
                self._flat[e.index] = torch.empty(0, dtype=torch.uint8, device=self.device).set_(e.storage)
            self.engine.wait_host(self.engine.d2h(block.view, self._flat[e.index]))
            if self.mixed(e):
                self.cast[e.index] = self.compute.alloc(e.nbytes)

    def mixed(self, e: Entry) -> bool:
        """Whether ``e``'s device copy has another dtype than its master (Note [Mixed precision])."""
        return e.dtype != e.master_dtype

    def to_compute(self, settle: Callable[[], Any] = lambda: None) -> None:
        """Every mixed entry's parameters become views of a device storage of the compute dtype, holding the
        masters cast (Note [Mixed precision]); their master-dtype device storage is let go. After ``allocate``,
        once the host buffers were shaped from the parameters as the user made them. ``settle()`` after each
        entry: the device memory's window is read there (Note [The model as it enters])."""
        for e in self.entries:
            if self.mixed(e):
                self._retype(e, e.dtype, e.nbytes, self.cast[e.index])
                settle()

    # Note [The model as it enters]
    # The model enters the manager on the device, as the user built it (fp32 under a compute dtype); the runtime
    # then makes each mixed entry's compute copy (a fresh device storage) and lets its fp32 storage go, entry by
    # entry, before streaming drops the copies. So the device's peak there is the weights as built plus the first
    # entry's copy (on CPU at test sizes: exactly that, as the meter sees it), a figure no plan covers (Note [The
    # memory before the first iteration] in swap.runtime.activations.executor). Measured as one window, torch's
    # allocator bounds it by the memory at its start plus every byte allocated in it (Note [Window peaks without
    # resetting torch's peak]): every entry's copy, as if none of the fp32 storages had gone. The 1B Llama on an
    # H200 read 6.67 GB there, 4.40 GB of fp32 weights plus 2.20 GB of bf16 copies. So the window is read after
    # each entry (``settle``): one allocation a window, which torch's statistics measure exactly.

    def to_master(self, e: Entry) -> None:
        """``e``'s parameters back in their master dtype on the device, holding the masters (the manager exits)."""
        self.ready(e)
        self._retype(e, e.master_dtype, e.master_nbytes, self.blocks[e.index])
        self.current[e.index] = self.allocated[e.index] = True
        self.placement[e.index] = Placement.RESIDENT

    def _retype(self, e: Entry, dtype: torch.dtype, nbytes: int, source: HostBlock) -> None:
        """``e``'s parameters re-pointed at a fresh device storage of ``dtype`` (``nbytes``), filled with the
        master cast to ``dtype``, made through ``source`` (the host block holding it in that dtype)."""
        i = e.index
        with torch.no_grad():
            if source is self.cast[i]:
                self._cast_master(e)
            fresh = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            with self.busy():
                self.engine.wait_host(self.engine.h2d(fresh, source.view))
            st = fresh.untyped_storage()
            for _, p in e.params:
                p.data = torch.empty(0, dtype=dtype, device=self.device).set_(st, p.storage_offset(), p.size(),
                                                                              p.stride())  # fmt: skip
        e.storage, e.key = st, st._cdata
        with _disable_current_modes():
            self._flat[i] = torch.empty(0, dtype=torch.uint8, device=self.device).set_(st)

    # Note [One cast per master change]
    # A fetch of a mixed entry reads its compute-dtype copy, cast from the fp32 master on the thread that fetches:
    # the main thread in a forward, autograd's in a backward, before the H2D copy is queued, so the device waits
    # for it. The masters change only at a host step, yet every fetch cast again: 8 casts of every master a step
    # for 4 micro-batches, 7 of them rewriting the bytes already there (3.1 GB of bf16 per micro-batch of the 1B
    # Llama, 1.1 s at one thread's 2.8 GB/s, against the 1.3 s the H200 lease measured a micro-batch). So the copy
    # is cast again only when the master may have changed since: ``changed`` marks it stale (the host step and
    # its speculation and rollback on the worker, before and after they write; a state dict handing out or loading
    # the master; a write-back), and, for any other write through the master tensors the runtime keeps
    # (``host_param``), their version counters, read at the cast, no longer match. Both are read before the cast
    # copies, so a change while it runs leaves the copy stale. The bytes are the same as casting at every fetch:
    # the cast is a pure function of the master. (A write no counter sees, through ``.data`` or numpy into a
    # tensor a state dict handed out, after the next fetch, is not seen: as autograd's saved-tensor check.)
    def changed(self, e: Entry) -> None:
        """``e``'s master was (or is about to be) written: its compute-dtype copy is cast again at its next fetch."""
        self._changes[e.index] += 1

    def _versions(self, i: int) -> tuple[int, ...]:
        hosts = self._hosts[i]
        return () if hosts is None else tuple(t._version for t in hosts)

    def _cast_current(self, i: int) -> bool:
        return self._cast_seen[i] == (self._changes[i], self._versions(i))

    def _cast_master(self, e: Entry) -> None:
        """The master of mixed entry ``e`` cast into its compute-dtype copy, on this thread, once the last copy
        that read that copy is done (the next H2D reads it); nothing to do if the copy is current (Note [One cast
        per master change])."""
        i = e.index
        if self._cast_current(i):
            return
        ticket = self._cast_h2d[i]
        if ticket is not None:
            self.engine.wait_host(ticket)
            self._cast_h2d[i] = None
        with torch._C._DisableTorchDispatch(), torch.no_grad():  # host memory: unseen by a meter (as copies are)
            seen = (self._changes[i], self._versions(i))  # read first: a change racing the cast leaves it stale
            dst = flat(self.cast[i].view, e.dtype, e.nbytes)
            dst.copy_(flat(self.blocks[i].view, e.master_dtype, e.master_nbytes))
        self._cast_seen[i] = seen
        self.casts += 1

    def _ensure_resizable(self, e: Entry) -> None:
        if e.storage.resizable():
            return
        with torch.no_grad():
            fresh = torch.empty(e.nbytes, dtype=torch.uint8, device=self.device)
            fresh.copy_(torch.empty(0, dtype=torch.uint8, device=self.device).set_(e.storage))
            st = fresh.untyped_storage()
            for _, p in e.params:
                p.data = torch.empty(0, dtype=p.dtype, device=self.device).set_(st, p.storage_offset(), p.size(),
                                                                                 p.stride())  # fmt: skip
        e.storage, e.key = st, st._cdata

    def host_param(self, e: Entry, p: torch.nn.Parameter) -> torch.Tensor:
        """The host master of parameter ``p`` of entry ``e``: the same geometry on the host, in the master dtype.
        Its version counter is read at each cast (Note [One cast per master change])."""
        t = host_tensor(self.blocks[e.index].view, p, p.storage_offset(), e.master_dtype)
        self._hosts[e.index] = [*(self._hosts[e.index] or []), t]
        self.changed(e)
        return t

    def host_bytes(self) -> int:
        return sum(b.size for b in self.blocks if b is not None)

    # -- device copies ----------------------------------------------------------------------------------
    def fetch(self, e: Entry) -> bool:
        """Starts bringing ``e``'s weights back (False if they are on the device already)."""
        i = e.index
        with self.lock:
            if self.current[i]:
                return False
            if not self.allocated[i]:
                e.storage.resize_(e.nbytes)
                self.allocated[i] = True
            self.current[i] = True
            source = self.blocks[i].view
            if self.mixed(e):  # Note [Mixed precision]: cast on the host, the link carries the compute dtype
                self._cast_master(e)
                source = self.cast[i].view
            with self.busy():
                self.h2d[i] = ticket = self.engine.h2d(self._flat[i], source)
            if self.mixed(e):
                self._cast_h2d[i] = ticket
            self.copies.weights_in += e.nbytes
            return True

    def ready(self, e: Entry) -> None:
        """``e``'s weights may be read now (waits for the copy in flight, if any)."""
        i = e.index
        ticket = self.h2d[i]
        if ticket is not None:
            self.copies.stall_seconds += self.engine.wait_compute(ticket)
            self.h2d[i] = None

    def drop(self, e: Entry) -> None:
        """``e``'s device copy no longer holds the weights: freed if streamed, stale if a host master's compute
        copy (copied back first only if it was written: Note [Device copies by storage resize])."""
        i = e.index
        with self.lock:
            if not self.current[i] or self.placement[i] == Placement.RESIDENT:
                return
            ticket = self.h2d[i]
            if ticket is not None:  # fetched but not read: the memory's next user comes after the copy
                self.copies.stall_seconds += self.engine.wait_compute(ticket)  # Note [Releases without host waits]
                self.h2d[i] = None
            if self.dirty[i]:
                self.write_back(e)
            if self.placement[i] == Placement.STREAMED:
                e.storage.resize_(0)
                self.allocated[i] = False
            self.current[i] = False

    def write_back(self, e: Entry) -> None:
        """The device copy was written: the host master takes its bytes (upcast from the compute dtype for a mixed
        entry: Note [Mixed precision])."""
        i = e.index
        self.ready(e)
        if not self.mixed(e):
            with self.busy():
                self.engine.wait_host(self.engine.d2h(self.blocks[i].view, self._flat[i]))
        else:
            if self._cast_h2d[i] is not None:
                self.engine.wait_host(self._cast_h2d[i])
                self._cast_h2d[i] = None
            with self.busy():
                self.engine.wait_host(self.engine.d2h(self.cast[i].view, self._flat[i]))
            with torch._C._DisableTorchDispatch(), torch.no_grad():
                flat(self.blocks[i].view, e.master_dtype, e.master_nbytes).copy_(flat(self.cast[i].view, e.dtype,
                                                                                      e.nbytes))  # fmt: skip
            self.changed(e)  # cast again from the master, as before (a NaN's payload need not survive the round trip)
        self.copies.weights_out += e.nbytes
        self.dirty[i] = False

    def write_back_dirty(self) -> None:
        with self.lock:
            for e in self.entries:
                if self.dirty[e.index] and self.current[e.index]:
                    self.write_back(e)

    def make_resident(self, e: Entry) -> None:
        """``e``'s weights on the device for good (a resident placement, or the manager exits): fetched, and its
        device copy is the truth from now on."""
        self.fetch(e)
        self.ready(e)
        self.placement[e.index] = Placement.RESIDENT

    def close(self) -> None:
        """Host masters go back to the pool (after ``restore`` of every entry, or with their views kept alive by
        whoever holds them)."""
        for i, block in enumerate(self.blocks):
            if block is not None:
                self.pool.free(block)
                self.blocks[i] = None
        for i, block in enumerate(self.cast):
            if block is not None:
                self.compute.free(block)
                self.cast[i] = None


def grad_span(p: torch.nn.Parameter, dtype: Optional[torch.dtype] = None) -> int:
    """Bytes of a host gradient buffer for ``p`` (its size and strides) in its dtype (or ``dtype``)."""
    itemsize = (dtype or p.dtype).itemsize
    return max(span_bytes(p) // p.element_size() * itemsize, itemsize)
