"""Which of an iteration's saved bytes are on the device, kept up to date by callbacks from variables.

A variable's storages die when autograd or the user lets go of them, on any thread (a node freed after it
ran, a garbage-collection callback), so the callbacks here never wait and never take the executor's lock:
they change byte counts under ``lock`` only (re-entrant: a callback can run on a thread that holds it).

Note [A held tensor freed mid-step]
A profiled step's ``nonswap`` is its peak less what was ours on the device when it opened
(swap.runtime.activations.recorder).
That is exact only if our bytes stay put until the peak. They do not when a device storage of a variable counted
at the open dies inside the step: the forward lets go of a tensor we released (a residual input), or the node
that used a variable runs and autograd frees it (the scan of a state-space model uses a state and frees it
before the next operator allocates). A peak after that free is lower by those bytes, so ``nonswap`` came out
low by them; a planned iteration, where the same variable can live a little longer (its copy still in flight,
held for a later use), then ran over its plan from its first iteration (Mamba, by 60 to 140 KiB). So the
bytes of such a storage are counted as held from the moment it dies (``DeviceMemory.add_held``), and the step's
peak is read with them (``held_window_peak``): exact where the memory measures it (CPU), and the freed bytes
added to the peak where it cannot (a GPU's allocator counters): an upper bound, never low. A copy that came
back inside the same step and died there was never counted at the step's open (a saved tensor read outside
backward, as a graph viewer does, and let go at once): no plan holds it longer, and counting each such read
as held would add up every saved tensor of the graph as if all were live at once.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Protocol

from ..machine.memory import DeviceMemory
from .recorder import Recorder
from .tracer import Variable


class Clock(Protocol):
    """Where the executor is (it is one): the iteration, its recorder while profiling, and the step."""

    iteration: int
    recorder: Optional[Recorder]

    @property
    def in_hook(self) -> bool:
        """A step is being taken (a callback inside it belongs to the step before)."""

    def now(self) -> int:
        """The step whose interval it is now."""


class Residency:
    """The owner of the executor's variables (``Variable.owner``): their callbacks land here, and
    ``on_device_bytes`` counts this iteration's variables whose bytes some device storage holds (the forward's,
    or a copy we fetched). ``memory`` learns what a run without swapping would hold; ``retire(var)`` lets a
    dead variable's memory go (swap.runtime.activations.transfers)."""

    def __init__(self, clock: Clock, memory: DeviceMemory, lock: threading.RLock,
                 retire: Callable[[Variable], None]) -> None:  # fmt: skip
        self.clock = clock
        self.memory = memory
        self.lock = lock
        self.retire = retire
        self.on_device_bytes = 0
        self._died_counted: dict[int, int] = {}  # variable -> the step it died in, counted (its bytes may go later)
        self._fetched_in: dict[int, int] = {}  # variable -> the step whose interval a copy of it came back in

    def reset(self) -> None:
        """A new iteration: none of its variables exists yet."""
        self.on_device_bytes = 0
        self._died_counted = {}
        self._fetched_in = {}

    def _freed_mid_step(self, var: Any) -> None:
        """Profiling: a device storage of ``var``, counted when the step opened, died inside the step (Note [A
        held tensor freed mid-step])."""
        clock = self.clock
        rec = clock.recorder
        if rec is not None and var.iteration == clock.iteration and not clock.in_hook:
            rec.held_freed(var.size)
            self.memory.add_held(var.size)

    def saved(self, var: Variable) -> None:
        """``var`` was made from a saved tensor's storage, which is on the device."""
        with self.lock:
            self.on_device_bytes += var.size

    def _set_on_device(self, var: Variable, flag: bool) -> None:
        """``var``'s bytes are on the device again, or its last device storage died (``flag`` False)."""
        with self.lock:
            if var.on_device == flag:
                return
            var.on_device = flag
            # counted at this step's open: alive, or died in this step; and not a copy that came back inside
            # this very step (a saved tensor read outside backward and let go at once: no plan holds it longer)
            now = self.clock.now()
            counted = (self._died_counted.pop(var.id, None) == now or var.alive) and self._fetched_in.get(var.id) != now
        if not flag and counted:
            self._freed_mid_step(var)
        with self.lock:
            if not var.alive:
                return
            delta = var.size if flag else -var.size
            if var.iteration == self.clock.iteration:
                self.on_device_bytes += delta
        self.memory.add_shadow(-delta)

    def copy_coming(self, var: Variable) -> None:
        """A copy of ``var`` is about to come back to the device (a run without swapping would hold it)."""
        if not var.on_device:
            self.memory.add_shadow(-var.size)
            with self.lock:
                var.on_device = True
                self._fetched_in[var.id] = self.clock.now()
                if var.alive and var.iteration == self.clock.iteration:
                    self.on_device_bytes += var.size

    # -- callbacks from variables (swap.runtime.activations.tracer) -------------------------------------------------
    def original_died(self, var: Variable) -> None:
        clock = self.clock
        rec = clock.recorder
        copy_alive = var.copy_ref is not None and var.copy_ref() is not None
        if rec is not None and var.iteration == clock.iteration:
            rec.held_until.setdefault(var.id, clock.now())
            if copy_alive and var.alive and var.dev is None:
                self._freed_mid_step(var)  # the forward's storage went; the copy we fetched stays
        if not copy_alive:
            self._set_on_device(var, False)  # its last device storage went: Note [A held tensor freed mid-step]

    def copy_died(self, var: Variable, ref: Any) -> None:
        if ref is not var.copy_ref:
            return
        var.copy_ref = None
        clock = self.clock
        rec = clock.recorder
        if rec is not None and var.iteration == clock.iteration:
            rec.copy_died(var.last_access, clock.now())  # Note [A fetched copy held past its node]
        if var.original() is None:
            self._set_on_device(var, False)

    def clean_fetched(self, var: Any) -> None:
        """A bucket of weights (swap.runtime.activations.clean) came to the device without a step of ours (its
        mover's own fetch: a forward without gradients, an evaluation between iterations)."""
        with self.lock:
            self._fetched_in[var.id] = self.clock.now()

    def clean_dropped(self, var: Any) -> None:
        """A bucket of weights (swap.runtime.activations.clean) left the device between two steps, where the
        conservative plan let go of it (a module returned): a planned run holds it until its planned release, so,
        while profiling, its bytes count as held for the rest of the step (Note [A held tensor freed mid-step]).
        Not a bucket that came back inside this very step without a step of ours (``clean_fetched``): counted at
        no step's open, it is held by no plan either. An evaluation pass after the optimizer step fetches and
        drops every bucket in the iteration's last interval; counting each drop as held added up every bucket the
        evaluation read, as if all were live at once (a Switch MoE with eval passes was refused, its tail planned
        at 1.42 MiB where 0.45 MiB was ever live)."""
        with self.lock:
            fetched_now = self._fetched_in.get(var.id) == self.clock.now()
        if not fetched_now:
            self._freed_mid_step(var)

    def var_dead(self, var: Variable) -> None:
        """Autograd released every handle of ``var``: its memory goes (now, or once its copies are done)."""
        if not var.alive:
            return
        clock = self.clock
        if clock.recorder is not None and var.iteration == clock.iteration:
            clock.recorder.freed[var.id] = clock.now()
        with self.lock:
            if var.on_device and var.iteration == clock.iteration:
                self.on_device_bytes -= var.size
                self._died_counted[var.id] = clock.now()  # Note [A held tensor freed mid-step]
            var.alive = False
        if not var.on_device:
            self.memory.add_shadow(-var.size)  # a run without swapping frees it now
        self.retire(var)
