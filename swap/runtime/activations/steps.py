"""Taking one step of an iteration: the executor finds where iterations begin and end (swap.runtime.activations
.executor); this takes each step inside one. A step is one access (a save or a use): in a planned iteration it
issues the schedule's releases, swap-ins and swap-outs around the access; while profiling it runs the
conservative plan and records the step. Either way it closes the interval before it with the highest memory
measured in it, counts an overrun of the budget, and notices when a planned iteration stops following its plan.

Note [Step windows]
A step's measured peak is the highest memory from its access to the next one. The window is restarted after
the access's releases, not before them: the memory they free belonged to the step before (it was counted
there), and counting it again would inflate the step, its plan, and ``min_budget``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ...schedule.sequence import SAVE, USE
from .clean import CleanVariable, on_device_bytes
from .lifecycle import PLANNED, PROFILE
from .recorder import Recorder, describe_step
from .tracer import Variable, current_autograd_node

log = logging.getLogger("swap")


class StepTaker:
    """Takes the steps of the executor's current iteration, in order. ``i`` is the next step's index;
    ``in_hook`` is set while one is being taken (callbacks that run inside it belong to the step before)."""

    def __init__(self, ex: Any) -> None:
        self.ex = ex  # the executor whose iteration this is (its plan, variables, copies and meters)
        self.i = 0
        self.in_hook = False
        self.actions: list[tuple[int, str, int]] = []  # what this iteration issued, in order
        self.matching = True  # profiling: so far this iteration repeats the previous profile
        self.span: Optional[tuple[int, CleanVariable]] = None  # the forward weight use whose module runs
        self.node_groups = 0
        self.last_node: Any = None

    def reset(self) -> None:
        """A new iteration: its first step is step 0."""
        self.i = 0
        self.actions = []
        self.matching = True

    def now(self) -> int:
        """The step whose interval it is now (for callbacks from variables)."""
        return self.i - 1 if self.in_hook else self.i

    def log(self, i: int, action: str, var: Variable) -> None:
        self.actions.append((i, action, var.id))

    def take(self, var: Variable, kind: str, storage: Optional[torch.UntypedStorage]) -> None:
        ex, i = self.ex, self.i
        self.i += 1
        self.in_hook = True
        try:
            var.last_access = i
            ex.transfers.process_dying()
            if i > 0:
                self.close(ex.memory.window_peak())
            life = ex.lifecycle
            if life.mode == PLANNED and not self._matches(var, kind, i):
                self._diverged(var, kind, i)
            if life.mode == PLANNED:
                self._planned(var, kind, storage, i)
            else:
                prev = life.previous if self.matching and life.mode == PROFILE else None
                grown = max(0, ex.recorder.base - prev.base) if prev is not None and ex.recorder else 0
                ex.conservative.step(var, kind, storage, i, ex.vars, prev, grown)
            rec = ex.recorder
            if rec is not None:
                prev = life.previous
                if self.matching and prev is not None:
                    self.matching = i < len(prev) and prev.var[i] == var.id and prev.kind[i] == kind
                counted = ex.residency.on_device_bytes + on_device_bytes(ex.clean.values(), ex.iteration)
                rec.open_step(var.id, kind, counted, ex.memory.current(), ex.kept.bytes,
                              self._node_group(kind), ex.saves)  # fmt: skip
                ex.timer.start()
        finally:
            self.in_hook = False

    def _node_group(self, kind: str) -> int:
        """Profiling: consecutive uses by one backward node share a group (the node holds what it unpacked)."""
        node = current_autograd_node() if kind == USE else None
        span = self.span
        if node is None and span is not None and span[1].pinned():  # Note [Clean variables at run time]
            return span[0]
        if node is None:
            self.last_node = None
            return -1
        if node is not self.last_node:
            self.last_node = node  # kept alive, so the next node cannot reuse its id
            self.node_groups += 1
        return self.node_groups

    def _matches(self, var: Variable, kind: str, i: int) -> bool:
        life = self.ex.lifecycle
        seq, n = life.sequence, var.size  # Note [Plans by input shape]: bounds
        return (i < len(seq) and seq.var[i] == var.id and seq.kind[i] == kind
                and (seq.sizes[var.id] == n or life.bounds and seq.sizes[var.id] > n)
                and (not seq.saved_before or seq.saved_before[i] == self.ex.saves))  # fmt: skip

    def _diverged(self, var: Variable, kind: str, i: int) -> None:
        ex = self.ex
        seq = ex.lifecycle.sequence
        expected = f"{seq.kind[i]} of {seq.sizes[seq.var[i]]} bytes" if i < len(seq) else "the end of the iteration"
        log.info("swap: step %d is a %s of %d bytes, the plan expected %s: re-profiling", i, kind, var.nbytes, expected)
        ex.lifecycle.diverged()
        ex.conservative.held = [v for v in ex.vars if v is not var and v.dev is not None and v.alive]

    def _planned(self, var: Variable, kind: str, storage: Optional[torch.UntypedStorage], i: int) -> None:
        ex = self.ex
        s, moves = ex.lifecycle.schedule, ex.transfers
        for u in s.release[i]:
            moves.release(ex.vars[u], i)
        if s.release[i]:
            ex.conservative.restart_window()  # Note [Step windows]
        for u in s.swap_in[i]:
            moves.swap_in(ex.vars[u], i)
        if kind == SAVE:
            if var.dev is None:
                var.attach(storage)
        else:
            moves.ensure_resident(var, i)
        self.log(i, "access", var)
        for u in s.swap_out[i]:
            moves.swap_out(ex.vars[u], i)

    def close(self, peak: int, tail: bool = False) -> None:
        """The interval after the previous access ended with ``peak`` the highest memory in it (``tail``: the
        iteration's last interval, through the optimizer step)."""
        ex = self.ex
        i = self.i - 2 if self.in_hook else self.i - 1  # the step whose interval this was
        rec = ex.recorder
        if rec is not None:
            rec.close_step(peak, ex.memory.held_window_peak(), ex.timer.stop())
        if peak <= ex.budget:
            return
        ex.counters.overruns += 1
        life = ex.lifecycle
        if rec is not None:
            rec.overruns.append((i, peak))
            life.profile_overrun(ex.iteration, peak, self._where(i, tail, rec))
        elif life.mode == PLANNED and i < len(life.sequence):
            life.planned_overrun(ex.iteration, i, peak, self._where(i, tail))

    def _where(self, i: int, tail: bool, rec: Optional[Recorder] = None) -> str:
        seq = self.ex.lifecycle.sequence
        var_ids, kinds = (rec.var, rec.kind) if rec is not None else (seq.var, seq.kind)
        return describe_step(i, tail, var_ids, kinds, [v.module for v in self.ex.vars], seq)
