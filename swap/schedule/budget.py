"""What a budget needs: each step's floor, the smallest feasible budget, and the signals a user gets.

- ``step_floors(seq)``: the least device memory step i can run in under any schedule: the memory that is
  not ours to move, the saved tensors the forward pass still holds, and the step's own variable.
- ``InfeasibleBudget``: raised when the largest floor exceeds the budget; it carries ``min_budget`` (the
  largest floor), the module at that step, what is live there, and which lever would lower it.
(``BudgetWarning``, the runtime's signal that it kept running but could not keep the budget, is in
swap.runtime.activations.signals.)

Pure: no torch, no I/O, so the scheduler and tests use it directly.
"""

from __future__ import annotations

from typing import Optional

from ..units import fmt_bytes, fmt_exact
from .sequence import SAVE, Sequence

LEVERS = ("min_bytes", "checkpoint", "batch", "budget")


# Note [A budget above the device's memory]
# A budget above the memory the run can have is refused with a ValueError that names the largest budget
# that fits, not clamped to it. The budget is the user's statement of what the run may use, and every
# figure made from it assumes the memory exists: swap.plan's largest batch and planned peak, the manager's
# plan and its decision to decline. A plan for 500 GiB on a 16 GiB V100 is no plan, and one silently made
# for 16 GiB instead answers a question nobody asked, in a table whose warning scrolls past; a clamp would
# also hide a typo (GiB for MiB) that the user wants to hear about. Refusing costs one edit, and the message
# gives the value to write. The memory compared with:
# - swap.plan and python -m swap.plan: the device profile's memory (``DeviceProfile.memory``);
# - SwapManager on a CUDA device: vmalloc's capacity when vmalloc is the allocator (the arena can hold no
#   more, whatever the device has; ``arena.set_capacity`` or ``vmalloc.configure(capacity=...)`` raise it),
#   else the device's total memory. Total, not free: the budget counts what the run holds already (the
#   model's weights), and free memory moves as the process runs;
# - SwapManager on the CPU: nothing. The "device" is host RAM, which also holds the swapped copies, and the
#   budget is live tensor bytes as ``LiveBytesMeter`` counts them, a limit for tests and simulation; any
#   budget is taken (tests pass budget="64GiB" to mean "anything fits").
def refuse_over_memory(budget: int, memory: int, what: str, instead: str) -> None:
    """Raises ValueError when ``budget`` exceeds ``memory`` (Note [A budget above the device's memory]);
    ``what`` names the memory, ``instead`` says what to write."""
    if budget > memory:
        raise ValueError(f"a budget of {fmt_bytes(budget)} is more than {what} ({fmt_bytes(memory)}): {instead}")


class InfeasibleBudget(ValueError):
    """No schedule keeps the device under the budget: at some step, what the step cannot do without exceeds it.

    Raised by the scheduler, and by ``SwapManager`` as soon as a profiled iteration shows it (at the first
    saved tensor of the next iteration, before that iteration adds anything). The figures are for the step
    whose floor is the *largest*, so ``budget=e.min_budget`` is enough for every step. Retry with it inside the
    ``except`` or after it: a manager that starts while this is handled first drops the failed run's frames from
    its traceback, which would otherwise keep that run's tensors alive (Note [Retrying inside except
    InfeasibleBudget] in swap/runtime/machine/resources.py).

    Attributes:
        budget: the budget that was asked for, in bytes.
        min_budget: the smallest budget this sequence can be planned for, in bytes (the largest step floor).
        needed: the same figure (the name earlier releases used).
        excess: ``min_budget - budget``.
        step: index of that step in the profiled sequence (for tools; the message names the module).
        phase: ``"forward"`` (a saved tensor was made), ``"backward"`` (one was used) or ``"end of iteration"``
            (after the last use: the rest of backward, the optimizer step, the next forward until its first
            saved tensor).
        module: path of the module at that step, e.g. ``"encoder.layer.3.attention"`` ("" when unknown).
        not_swappable: bytes live there that swapping cannot move: what was live when the iteration began
            (parameters, gradients, optimizer state, inputs) and saved tensors that stay on the device
            (held elsewhere, under ``min_bytes`` or excluded).
        kept_by_min_bytes: the part of ``not_swappable`` kept by ``min_bytes`` or ``exclude``.
        held_by_forward: bytes live there that the pass itself holds: activations not consumed yet, saved
            tensors it still references (a residual input), gradients in flight during backward.
        working_set: the step's own bytes: the saved tensor it makes or uses, and what its operation
            allocates. ``not_swappable + held_by_forward + working_set == min_budget``.
        failing_steps: how many steps exceed the budget.
        lever: what would lower the peak: ``"min_bytes"`` (let smaller tensors move), ``"checkpoint"``
            (checkpoint ``module``, so the forward holds less), ``"batch"`` (lower the batch size: the
            step's own working set is too large) or ``"budget"`` (at the end of the iteration: parameters,
            gradients and optimizer state, which swapping activations cannot lower).
        advice: that lever as a sentence.
    """

    def __init__(
        self,
        step: int,
        needed: int,
        budget: int,
        detail: str = "",
        *,
        phase: str = "",
        module: str = "",
        not_swappable: int = 0,
        kept_by_min_bytes: int = 0,
        held_by_forward: int = 0,
        working_set: Optional[int] = None,
        failing_steps: int = 1,
        lever: str = "batch",
        advice: str = "",
        note: str = "",
    ) -> None:
        self.step, self.needed, self.min_budget, self.budget = step, needed, needed, budget
        self.excess = needed - budget
        self.phase, self.module = phase, module
        self.not_swappable, self.kept_by_min_bytes = not_swappable, kept_by_min_bytes
        self.held_by_forward = held_by_forward
        self.working_set = needed - not_swappable - held_by_forward if working_set is None else working_set
        self.failing_steps, self.lever = failing_steps, lever
        self.advice = advice or "Raise the budget, lower the batch size, or checkpoint that part of the model."
        if phase == "end of iteration":
            where = "the end of the iteration (the rest of backward, the optimizer step)"
        elif module:
            where = f"the {phase} of {module}"
        else:
            where = f"step {step}" + (f" ({phase})" if phase else "")
        parts = [
            f"no schedule fits the budget of {fmt_exact(budget)}: {where} needs {fmt_exact(needed)}, "
            f"{fmt_bytes(needed - budget)} over"
        ]
        if failing_steps > 1:
            parts[0] += f" ({failing_steps} steps exceed the budget; this is the largest)"
        if detail:
            parts.append(detail)
        else:
            parts.append(
                f"Live there: {fmt_bytes(self.not_swappable)} not swappable"
                + (f" ({fmt_bytes(kept_by_min_bytes)} of it saved tensors kept by min_bytes/exclude)"
                   if kept_by_min_bytes else "")
                + f", {fmt_bytes(self.held_by_forward)} held by the {'forward' if phase == 'forward' else 'backward'}"
                f" pass, {fmt_bytes(self.working_set)} working set of the operation"
            )  # fmt: skip
        parts.append(self.advice)
        if note:
            parts.append(note)
        parts.append(f"The smallest budget this run can be planned for is min_budget={needed}.")
        super().__init__(". ".join(p.rstrip(".") for p in parts) + "")


def step_floors(seq: Sequence) -> list[int]:
    """Per step, the least device memory it can run in: ``nonswap[i]``, the step's own variable (if
    swappable), and the swappable variables the forward pass (``held_until``) or the running backward node
    (``node_last``) still holds then."""
    held, pinned = _held_bytes(seq), _pinned(seq)
    ends, first = seq.ends(), _first_access(seq)
    floors = []
    for i, v in enumerate(seq.var):
        own = seq.sizes[v] if seq.swappable[v] and not _is_held(seq, v, i, first, ends) else 0
        if v in pinned[i]:
            own = 0
        floors.append(seq.nonswap[i] + held[i] + own + sum(seq.sizes[u] for u in pinned[i]
                                                           if not _is_held(seq, u, i, first, ends)))  # fmt: skip
    return floors


def _pinned(seq: Sequence) -> list[set[int]]:
    """Per step: swappable variables an earlier use of the same backward node still holds."""
    out: list[set[int]] = [set() for _ in range(len(seq))]
    ends = seq.ends()
    for j, (v, last) in enumerate(zip(seq.var, seq.node_last)):
        if last > j and seq.swappable[v]:
            for i in range(j + 1, min(last, ends[v] - 1) + 1):
                out[i].add(v)
    return out


def min_budget(seq: Sequence) -> int:
    """The smallest budget ``seq`` can be planned for (0 for an empty sequence)."""
    return max(step_floors(seq), default=0)


def _first_access(seq: Sequence) -> list[int]:
    first = [len(seq)] * len(seq.sizes)
    for i in range(len(seq) - 1, -1, -1):
        first[seq.var[i]] = i
    return first


def _is_held(seq: Sequence, v: int, i: int, first: list[int], ends: list[int]) -> bool:
    """Variable v is already counted among the held ones at step i."""
    return first[v] < i < min(seq.held_until[v], ends[v])


def _held_bytes(seq: Sequence) -> list[int]:
    """Per step: bytes of swappable variables saved earlier that the forward still holds (not releasable)."""
    n, ends, first = len(seq), seq.ends(), _first_access(seq)
    delta = [0] * (n + 1)
    for v, f in enumerate(first):
        stop = min(seq.held_until[v], ends[v], n)
        if f < n and seq.swappable[v] and stop > f + 1:
            delta[f + 1] += seq.sizes[v]
            delta[stop] -= seq.sizes[v]
    out, cur = [], 0
    for i in range(n):
        cur += delta[i]
        out.append(cur)
    return out


def diagnose(seq: Sequence, budget: int, note: str = "") -> Optional[InfeasibleBudget]:
    """The error for ``seq`` at ``budget``, with the largest failing step's breakdown; None if it fits.
    ``note`` is added to the message."""
    floors = step_floors(seq)
    if not floors or max(floors) <= budget:
        return None
    i = max(range(len(floors)), key=lambda k: (floors[k], -k))
    v, need = seq.var[i], floors[i]
    ends, first = seq.ends(), _first_access(seq)
    own = seq.sizes[v] if seq.swappable[v] and not _is_held(seq, v, i, first, ends) else 0
    working = min(need, own + seq.transient[i])
    stuck = sum(seq.sizes[u] for u in range(len(seq.sizes))
                if not seq.swappable[u] and first[u] <= i < ends[u])  # fmt: skip
    not_swappable = min(need - working, seq.base + seq.kept[i] + stuck)
    held = need - working - not_swappable
    last = i == len(seq) - 1 and seq.kind[i] != SAVE
    phase = "end of iteration" if last else "forward" if seq.kind[i] == SAVE else "backward"
    module = seq.modules[v] if seq.modules else ""
    excess = need - budget
    kept = min(seq.kept[i], not_swappable)
    where = module or "that part of the model"
    if kept >= excess:
        lever = "min_bytes"
        advice = (f"Lower min_bytes (or exclude less): {fmt_bytes(kept)} of saved tensors stay on the device there "
                  "because they are under min_bytes or excluded")  # fmt: skip
    elif last:
        lever = "budget"
        advice = ("What is live there is mostly parameters, gradients and optimizer state (with the optimizer's "
                  "temporaries): swapping activations cannot lower it. Raise the budget (an optimizer with less "
                  "state, or foreach=False for fewer temporaries, would also lower it)")  # fmt: skip
    elif phase == "forward" and held >= excess:
        lever = "checkpoint"
        advice = (f"Checkpoint {where} (torch.utils.checkpoint.checkpoint(..., use_reentrant=False)): the forward "
                  f"pass holds {fmt_bytes(held)} of activations there that swapping cannot release")  # fmt: skip
    else:
        lever = "batch"
        advice = (f"Lower the batch size: the operation's own working set there is {fmt_bytes(working)}, and what "
                  "the pass holds cannot be swapped out")  # fmt: skip
    if lever != "budget":
        advice += ", or raise the budget"
    return InfeasibleBudget(
        i, need, budget, phase=phase, module=module, not_swappable=not_swappable, kept_by_min_bytes=kept,
        held_by_forward=held, working_set=working, failing_steps=sum(f > budget for f in floors), lever=lever,
        advice=advice, note=note,
    )  # fmt: skip
