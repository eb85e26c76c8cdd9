"""Streaming the weights: each use fetches its bucket, drops what no longer needs to be on the device, and fetches
ahead what the last pass used next.

Note [Weight uses]
A *use* of entries is a module's forward pre-hook (the parameters it owns), a backward read of a saved parameter
view (the saved-tensor hooks hand it here: ``pack`` / ``unpack``), or a demand fetch by the parameter guard (Note
[Parameter guard]). At a use the streamer, in this order: drops every bucket it holds that this use does not need,
unless the backward node running now has read it (a node reads all its saved tensors before it computes, so a
bucket one of them aliases must stay until the node has run); fetches the buckets the use needs, each only after
its pending host update (update-before-use: Note [Host step after confirmation] in
swap.runtime.model_state.host_step); and asks the prefetcher for what to fetch ahead. Demand fetches drop nothing
(they run inside an operator). A backward pass's end drops everything, so no weights are held across the optimizer
step. Only ``STREAMED`` buckets are held and dropped that way: a ``HOST_MASTER`` bucket keeps its device copy
(refreshed in place at its first use after a host step) and a ``RESIDENT`` one is never touched. The uses of a
pass (a forward and its backward) are recorded entry by entry: the next pass's prefetcher reads
them, and the first forward's order of first uses is the order buckets are re-packed in (Note [Entries and
buckets]).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Protocol

import torch

from ...schedule.model_state import Placement
from ..tracer import backward_running, current_autograd_node
from .buckets import Entry, pack
from .storage import Copies, Masters


class Prefetcher(Protocol):
    """Says what to fetch ahead after a use (the simple look-ahead here; the window schedule later)."""

    def ahead(self, step: int, used: tuple[int, ...]) -> tuple[int, ...]:
        """Entries to start fetching after use number ``step`` of this pass, which used entries ``used``."""

    def new_pass(self, previous: Optional[list[tuple[int, ...]]]) -> None:
        """A pass begins; ``previous`` is the last complete pass's uses (None: none yet)."""


class LookAhead:
    """Fetches the next use's entries as the last pass made them, while this pass repeats it use for use."""

    def __init__(self) -> None:
        self.previous: Optional[list[tuple[int, ...]]] = None
        self.matching = False

    def new_pass(self, previous: Optional[list[tuple[int, ...]]]) -> None:
        self.previous, self.matching = previous, previous is not None

    def ahead(self, step: int, used: tuple[int, ...]) -> tuple[int, ...]:
        prev = self.previous
        if not self.matching or step >= len(prev) or prev[step] != used:
            self.matching = False
            return ()
        return prev[step + 1] if step + 1 < len(prev) else ()


class ParamPacked:
    """A saved view of a managed parameter, as autograd stores it: fetched back at unpack."""

    __slots__ = ("tensor", "entry")

    def __init__(self, tensor: torch.Tensor, entry: int) -> None:
        self.tensor = tensor
        self.entry = entry


class Streamer:
    """Streams ``entries`` in ``buckets`` (lists of entry indices) of about ``bucket_bytes``, through ``masters``.
    ``gate(bucket)`` waits for the bucket's pending host update, ``updated(bucket)`` says whether it has none;
    ``fits(nbytes)`` says whether a prefetch of that many bytes keeps the budget; ``backward_ended()`` is told when
    a backward pass ends (after the drops); ``before_repack()`` runs before buckets are re-packed (nothing may be
    pending on the old ones)."""

    def __init__(self, entries: list[Entry], masters: Masters, bucket_bytes: int, gate: Callable[[int], None],
                 updated: Callable[[int], bool], fits: Callable[[int], bool], copies: Copies,
                 prefetcher: Optional[Prefetcher] = None, backward_ended: Callable[[], None] = lambda: None,
                 before_repack: Callable[[], None] = lambda: None) -> None:  # fmt: skip
        self.entries = entries
        self.masters = masters
        self.bucket_bytes = bucket_bytes
        self.gate = gate
        self.updated = updated
        self.fits = fits
        self.copies = copies
        self.prefetcher: Prefetcher = prefetcher or LookAhead()
        self.backward_ended = backward_ended
        self.before_repack = before_repack
        self.watched = {e.key: e.index for e in entries}  # storage identity -> entry
        self.lock = threading.RLock()
        self.buckets: list[list[int]] = []
        self.bucket_of: list[int] = []
        self.placements: list[Placement] = []
        self.repack(range(len(entries)))
        self.packed_by_use = False
        self.held: set[int] = set()  # buckets on the device
        self.uses: list[tuple[int, ...]] = []  # this pass's uses
        self.previous: Optional[list[tuple[int, ...]]] = None
        self.first_use: list[int] = []  # entries in the order the first forward read them
        self._first_seen: set[int] = set()
        self._pass_over = True  # the next forward use begins a pass
        self._in_backward = False
        self._backward_in_pass = False
        self._node: Any = None  # the backward node running at the last use, and the buckets it read
        self._node_buckets: set[int] = set()
        self._handles: list[Any] = []

    # -- buckets ----------------------------------------------------------------------------------------
    def repack(self, order: Any) -> None:
        """Buckets of entries in ``order`` (Note [Entries and buckets])."""
        self.buckets = pack([e.nbytes for e in self.entries], order, self.bucket_bytes)
        self.placements = [Placement.STREAMED] * len(self.buckets)
        self.bucket_of = [0] * len(self.entries)
        for b, members in enumerate(self.buckets):
            for i in members:
                self.bucket_of[i] = b

    def bucket_bytes_of(self, b: int) -> int:
        return sum(self.entries[i].nbytes for i in self.buckets[b])

    # -- hooks ------------------------------------------------------------------------------------------
    def install(self, model: torch.nn.Module) -> None:
        """Forward pre-hooks on every module that owns managed parameters."""
        owned = {id(p): e.index for e in self.entries for _, p in e.params}
        seen: set[int] = set()
        for module in model.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            mine = tuple(dict.fromkeys(owned[id(p)] for p in module.parameters(recurse=False) if id(p) in owned))
            if mine:
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(mine)))

    def _pre_hook(self, mine: tuple[int, ...]) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self.use(mine)

        return hook

    def uninstall(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def pack(self, t: torch.Tensor) -> Optional[ParamPacked]:
        """A saved tensor aliasing a managed parameter's storage, as autograd will keep it; else None."""
        entry = self.watched.get(t.untyped_storage()._cdata)
        return None if entry is None else ParamPacked(t, entry)

    def unpack(self, packed: ParamPacked) -> torch.Tensor:
        self.in_backward()
        self.use((packed.entry,))
        return packed.tensor

    def in_backward(self) -> None:
        """A backward pass runs (a saved parameter is read, or a gradient arrives): its end is queued once."""
        with self.lock:
            if not self._in_backward:
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
                self._in_backward = self._backward_in_pass = True

    # -- uses -------------------------------------------------------------------------------------------
    def use(self, used: tuple[int, ...]) -> None:
        """Note [Weight uses]."""
        with self.lock:
            self._maybe_begin_pass(used)
            step = len(self.uses)
            self.uses.append(used)
            if not self._in_backward:
                self._note_first_use(used)
            buckets = {self.bucket_of[i] for i in used}
            keep = set(buckets)
            node = current_autograd_node()
            if node is not None:
                if node is not self._node:
                    self._node, self._node_buckets = node, set()
                keep |= self._node_buckets
                self._node_buckets |= buckets
            for b in list(self.held - keep):
                self.drop_bucket(b)
            for b in buckets:
                self.fetch_bucket(b)
            for b in buckets:
                for i in self.buckets[b]:
                    self.masters.ready(self.entries[i])
            self._prefetch(step, used)

    def demand(self, entry: int) -> None:
        """The parameter guard found ``entry`` dropped under an operator: fetched now, nothing dropped."""
        with self.lock:
            self._maybe_begin_pass((entry,))
            self.copies.demand_fetches += 1
            self.uses.append((entry,))
            if not self._in_backward:
                self._note_first_use((entry,))
            b = self.bucket_of[entry]
            self.fetch_bucket(b)
            for i in self.buckets[b]:
                self.masters.ready(self.entries[i])

    def _note_first_use(self, used: tuple[int, ...]) -> None:
        for i in used:
            if i not in self._first_seen:
                self._first_seen.add(i)
                self.first_use.append(i)

    def fetch_bucket(self, b: int) -> None:
        placement = self.placements[b]
        if placement == Placement.RESIDENT:
            return
        if b not in self.held:
            self.gate(b)
            if placement == Placement.STREAMED:
                self.held.add(b)
        for i in self.buckets[b]:
            self.masters.fetch(self.entries[i])

    def drop_bucket(self, b: int) -> None:
        for i in self.buckets[b]:
            self.masters.drop(self.entries[i])
        self.held.discard(b)

    def drop_all(self, stale: bool = False) -> None:
        """Every streamed bucket off the device (dirty ones copied back); ``stale``: host masters' compute copies
        marked stale too (their masters are about to change)."""
        with self.lock:
            for b in list(self.held):
                self.drop_bucket(b)
            if stale:
                for b, placement in enumerate(self.placements):
                    if placement == Placement.HOST_MASTER:
                        self.drop_bucket(b)

    def _prefetch(self, step: int, used: tuple[int, ...]) -> None:
        wanted = self.prefetcher.ahead(step, used)
        for b in dict.fromkeys(self.bucket_of[i] for i in wanted):
            placement = self.placements[b]
            if placement == Placement.RESIDENT or b in self.held or not self.updated(b):
                continue
            if placement == Placement.STREAMED and not self.fits(self.bucket_bytes_of(b)):
                continue  # a host master's refresh takes no new memory
            self.fetch_bucket(b)

    # -- passes -----------------------------------------------------------------------------------------
    def _maybe_begin_pass(self, used: tuple[int, ...]) -> None:
        """A pass begins at the first forward use after a backward pass, or when a forward starts over without
        one (an evaluation loop repeats its first use), so a pass never grows without bound."""
        if self._in_backward and not backward_running():
            self._backward_end()  # Note [A backward that raised] (swap.runtime.executor): no end callback came
        if self._in_backward:
            return
        if self._pass_over or (not self._backward_in_pass and self.uses and used == self.uses[0]):
            if self.uses:
                self.previous = self.uses
            self.uses = []
            self._pass_over = self._backward_in_pass = False
            self.prefetcher.new_pass(self.previous)

    def _backward_end(self) -> None:
        with self.lock:
            self._in_backward = False
            self._node, self._node_buckets = None, set()
            self.drop_all()
            self._pass_over = True
            if not self.packed_by_use and self.first_use and all(p == Placement.STREAMED for p in self.placements):
                self.packed_by_use = True  # Note [Entries and buckets]: once, after the first pass
                self.before_repack()
                self.repack(self.first_use)  # the recorded uses are of entries: they stand
        self.backward_ended()
