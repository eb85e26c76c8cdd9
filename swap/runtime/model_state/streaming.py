"""Streaming the weights: each use fetches its bucket, drops what no longer needs to be on the device, and fetches
ahead what the last pass used next.

Note [Weight uses]
A *use* of entries is a module's forward pre-hook (the parameters it owns), a backward read of a saved parameter
view (both told here by swap.runtime.model_state.weight_hooks), or a demand fetch by the parameter guard (Note
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

While the executor plans (it profiles or follows a schedule, with gradients on), each use of a streamed bucket is a
step of its iteration instead (``step_hook``; Note [Clean variables at run time] in swap.runtime.activations.clean): the
window schedules the bucket's fetches and drops with the activations', and the streamer only carries them out, as
the executor's ``CleanMover``. A bucket is pinned while a module whose forward pre-hook used it runs, or while the
backward node that read it runs; a drop asked for then waits for the pin to end.

Note [Reads between passes]
A demand fetch while no pass is under way (after a backward pass ended, before the next forward's first use) and
without gradients is no use of a pass: ``model.load_state_dict`` copying into the parameters, a user's
``p.norm()`` under ``no_grad``. It fetches the bucket (dropped again at the next use) and records nothing: it
neither begins a pass nor sets the order buckets are re-packed in (a checkpoint's key order is not the
forward's), and the next pass does not learn to fetch it ahead at that point of its forward.

A parameter read outside the modules that own it (a tied embedding read by the parent's forward) is a demand fetch
the first time. The streamer remembers after which forward hook event (a pre- or post-hook of a module owning
parameters, counted from the pass's start) the read came, and from the next pass on uses the entry at that event,
pinned until the next one: a planned use, fetched ahead by the window like any other.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Protocol

import torch

from ...schedule.model_state import Placement, pack
from ..activations.clean import CleanVariable
from ..activations.tracer import backward_running, current_autograd_node
from .buckets import Entry
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


class Streamer:
    """Streams ``entries`` in ``buckets`` (lists of entry indices) of about ``bucket_bytes``, through ``masters``.
    ``gate(bucket)`` waits for the bucket's pending host update, ``updated(bucket)`` says whether it has none;
    ``fits(nbytes)`` says whether a prefetch of that many bytes keeps the budget; ``backward_ended()`` is told when
    a backward pass ends (after the drops); ``before_repack()`` runs before buckets are re-packed (nothing may be
    pending on the old ones)."""

    def __init__(self, entries: list[Entry], masters: Masters, bucket_bytes: int, gate: Callable[[int], None],
                 updated: Callable[[int], bool], fits: Callable[[int], bool], copies: Copies,
                 prefetcher: Optional[Prefetcher] = None, backward_ended: Callable[[], None] = lambda: None,
                 before_repack: Callable[[], None] = lambda: None,
                 step_hook: Optional[Callable[[int, int, str], bool]] = None) -> None:  # fmt: skip
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
        # step_hook(bucket, bytes, module): the executor takes the use as a step (True), or leaves it to us
        self.step_hook = step_hook
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
        self._spans: dict[int, int] = {}  # bucket -> forwards under way of modules that used it
        self._event = 0  # forward hook events of this pass
        self._reads: dict[int, set[int]] = {}  # event -> entries read after it outside their modules
        self._event_pins: set[int] = set()  # buckets used at the last event for such a read
        self._deferred: set[int] = set()  # drops asked for while pinned
        self._vars: dict[int, CleanVariable] = {}  # bucket -> the executor's variable of it, this iteration

    # -- buckets ----------------------------------------------------------------------------------------
    # Note [Variables across a re-pack]
    # The executor's variables of the iteration under way name buckets by index, and it still asks where they are
    # after the backward pass that re-packs (it releases an iteration's leftovers when the next one begins). Those
    # buckets are gone, and every one was dropped before the re-pack, so a variable made before it is answered
    # "not on the device"; re-packing can change the number of buckets (an order of first uses that packs
    # tighter), so an old index may not even exist any more.
    def repack(self, order: Any) -> None:
        """Buckets of entries in ``order`` (Note [Entries and buckets])."""
        self._vars = {}
        self.buckets = pack([e.nbytes for e in self.entries], self.bucket_bytes, order)
        self.placements = [Placement.STREAMED] * len(self.buckets)
        self.bucket_of = [0] * len(self.entries)
        for b, members in enumerate(self.buckets):
            for i in members:
                self.bucket_of[i] = b

    def bucket_bytes_of(self, b: int) -> int:
        return sum(self.entries[i].nbytes for i in self.buckets[b])

    # -- what the model's hooks tell (swap.runtime.model_state.weight_hooks) --------------------------------
    def module_returned(self, mine: tuple[int, ...]) -> None:
        """A module owning entries ``mine`` returned from its forward: its pins end, and so does its hook event."""
        with self.lock:
            for b in dict.fromkeys(self.bucket_of[i] for i in mine):
                if self._spans.get(b, 0) > 0:
                    self._spans[b] -= 1
        self.next_event()
        with self.lock:
            self._drop_deferred()

    def next_event(self) -> None:
        """A forward hook event: the reads outside their modules learned at it become uses, pinned until the
        next event."""
        if self._in_backward:
            return
        with self.lock:
            self._event += 1
            self._event_pins = set()
            reads = tuple(sorted(self._reads.get(self._event, ())))
        if reads:
            self.use(reads, pin_to_event=True)

    def in_backward(self) -> None:
        """A backward pass runs (a saved parameter is read, or a gradient arrives): its end is queued once."""
        with self.lock:
            if not self._in_backward:
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
                self._in_backward = self._backward_in_pass = True

    # -- uses -------------------------------------------------------------------------------------------
    def use(self, used: tuple[int, ...], module: str = "", span: bool = False, pin_to_event: bool = False) -> None:
        """Note [Weight uses]; ``span``: a module's forward pre-hook (its post-hook ends the pin); ``pin_to_event``:
        a learned read outside the owning modules (the next hook event ends the pin)."""
        with self.lock:
            self._maybe_begin_pass(used)
            step = len(self.uses)
            self.uses.append(used)
            if not self._in_backward:
                self._note_first_use(used)
            buckets = list(dict.fromkeys(self.bucket_of[i] for i in used))
            for b in buckets:
                if span:
                    self._spans[b] = self._spans.get(b, 0) + 1
                if pin_to_event:
                    self._event_pins.add(b)
            keep = set(buckets)
            node = current_autograd_node()
            if node is not None:
                if node is not self._node:
                    self._node, self._node_buckets = node, set()
                    self._drop_deferred()
                keep |= self._node_buckets
                self._node_buckets |= set(buckets)
        # Outside our lock: the executor takes its own, and its callbacks (a backward's end) take ours.
        hook = self.step_hook
        taken = [hook is not None and self.placements[b] == Placement.STREAMED
                 and hook(b, self.bucket_bytes_of(b), module) for b in buckets]  # fmt: skip
        with self.lock:
            if not any(taken):
                for b in list(self.held - keep):
                    self.drop_bucket(b)
            for b, by_executor in zip(buckets, taken):
                if not by_executor:
                    self.fetch_bucket(b)
                    self.ready(b)
            if not any(taken):
                self._prefetch(step, used)

    def demand(self, entry: int) -> None:
        """The parameter guard found ``entry`` dropped under an operator: fetched now, nothing dropped (Note
        [Reads between passes])."""
        with self.lock:
            self.copies.demand_fetches += 1
            if self._pass_over and not self._in_backward and not torch.is_grad_enabled():
                b = self.bucket_of[entry]
                self.fetch_bucket(b)
                self.ready(b)
                return
            self._maybe_begin_pass((entry,))
            self.uses.append((entry,))
            if not self._in_backward:
                self._note_first_use((entry,))
                self._reads.setdefault(self._event, set()).add(entry)  # a use there from the next pass on
            b = self.bucket_of[entry]
            self.fetch_bucket(b)
            self.ready(b)

    def _note_first_use(self, used: tuple[int, ...]) -> None:
        for i in used:
            if i not in self._first_seen:
                self._first_seen.add(i)
                self.first_use.append(i)

    def fetch_bucket(self, b: int, by_executor: bool = False) -> None:
        placement = self.placements[b]
        if placement == Placement.RESIDENT:
            return
        if b not in self.held:
            self.gate(b)
            if placement == Placement.STREAMED:
                self.held.add(b)
                if not by_executor and (var := self._vars.get(b)) is not None:
                    var.owner.clean_fetched(var)  # a fetch that is no step of the executor's
        for i in self.buckets[b]:
            self.masters.fetch(self.entries[i])

    def drop_bucket(self, b: int, early: bool = True) -> None:
        """``b`` off the device. ``early``: a drop the executor did not ask for, where a planned run may hold the
        bucket longer (a module returned; a use that needs other buckets): the executor is told (Note [Clean
        variables at run time]). Not early: the executor's own release, and the drops every run makes at the same
        point (a backward pass's end, an optimizer step), which no plan holds past."""
        if b in self.held and early and (var := self._vars.get(b)) is not None:
            var.owner.clean_dropped(var)
        for i in self.buckets[b]:
            self.masters.drop(self.entries[i])
        self.held.discard(b)
        self._deferred.discard(b)

    # -- the executor's mover (swap.runtime.activations.clean.CleanMover) ------------------------------------------
    def fetch(self, key: int, prefetch: bool) -> None:
        with self.lock:
            self._deferred.discard(key)
            if not (prefetch and not self.updated(key)):  # a prefetch never waits for a host update
                self.fetch_bucket(key, by_executor=True)

    def ready(self, key: int) -> float:
        before = self.copies.stall_seconds
        for i in self.buckets[key]:
            self.masters.ready(self.entries[i])
        return self.copies.stall_seconds - before

    def drop(self, key: int) -> None:
        with self.lock:
            if self.pinned(key):
                self._deferred.add(key)
            else:
                self.drop_bucket(key, early=False)

    def on_device(self, key: int) -> bool:
        if key not in self._vars:  # made before a re-pack: Note [Variables across a re-pack]
            return False
        current = self.masters.current
        return all(current[i] for i in self.buckets[key])

    def pinned(self, key: int) -> bool:
        if self._spans.get(key, 0) > 0 or key in self._event_pins:
            return True
        return key in self._node_buckets and current_autograd_node() is self._node

    def variables(self, first_id: int, iteration: int, owner: Any) -> list[CleanVariable]:
        streamed = [b for b, p in enumerate(self.placements) if p == Placement.STREAMED]
        made = [CleanVariable(first_id + k, b, self.bucket_bytes_of(b), self, iteration, owner)
                for k, b in enumerate(streamed)]  # fmt: skip
        self._vars = {v.key: v for v in made}
        return made

    def _drop_deferred(self) -> None:
        for b in list(self._deferred):
            if not self.pinned(b):
                self.drop_bucket(b)

    def drop_all(self, stale: bool = False) -> None:
        """Every streamed bucket off the device (dirty ones copied back); ``stale``: host masters' compute copies
        marked stale too (their masters are about to change)."""
        with self.lock:
            for b in list(self.held):
                self.drop_bucket(b, early=False)
            if stale:
                for b, placement in enumerate(self.placements):
                    if placement == Placement.HOST_MASTER:
                        self.drop_bucket(b, early=False)

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
            # Note [A backward that raised] (swap.runtime.activations.executor): no end callback came
            self._backward_end()
        if self._in_backward:
            return
        if self._pass_over or (not self._backward_in_pass and self.uses and used == self.uses[0]):
            if self.uses:
                self.previous = self.uses
            self.uses = []
            self._pass_over = self._backward_in_pass = False
            self._spans, self._event, self._event_pins = {}, 0, set()  # a forward that raised leaves no pin behind
            self.prefetcher.new_pass(self.previous)

    def _backward_end(self) -> None:
        with self.lock:
            self._in_backward = False
            self._node, self._node_buckets, self._spans = None, set(), {}
            self.drop_all()
            self._pass_over = True
            if not self.packed_by_use and self.first_use and all(p == Placement.STREAMED for p in self.placements):
                self.packed_by_use = True  # Note [Entries and buckets]: once, after the first pass
                self.before_repack()
                self.repack(self.first_use)  # the recorded uses are of entries: they stand
        self.backward_ended()
