"""What the manager tells the user while training goes on: ``BudgetWarning``s, once per cause, and notes; both
end up in the report's notes.

Note [Nothing to move, over the budget]
One condition warns: the highest memory measured is over the budget and the manager may move nothing
(every saved tensor is under min_bytes, excluded, a parameter, or alive elsewhere). It is judged wherever
a peak is measured: at the end of each profiling iteration, and, once the manager has declined with
nothing to manage, after every backward pass (the executor's ``unmanaged`` callback). Judging it at the
profiles alone missed runs whose memory grows after them: with gradient accumulation the two profiled
iterations are micro-batches that run before the optimizer has made its state, and a later iteration
(longer sequences, a larger batch) can need more. The BudgetWarning and the report's note are one
call (``Notices.warn``): the same text, once per cause. The counts in it are of one profiled iteration.

Note [The figure a warning quotes]
The first judgement comes at the end of the first profiling iteration, before the optimizer's first step has
made its state (Adam's moments, momentum), so the highest memory measured then is less than what every
later iteration reaches. The warning says the figure is the highest "so far", the report's note is kept at
the highest figure measured since, and when a later iteration goes higher than the warning said by more than
``REWARN_ABOVE`` of it, the warning is given once more with the figure the run really reaches.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Optional

from ..schedule.sequence import Sequence
from ..units import fmt_bytes
from .activations.hooks import SavedTensorHooks
from .activations.signals import BudgetWarning

log = logging.getLogger("swap")
REWARN_ABOVE = 1 / 32  # Note [The figure a warning quotes]

# Why strategy "auto" plans no recompute when the manager takes no saved tensor: its plan is made on the
# profiled sequence of the tensors the manager takes (swap.joint.search), and min_bytes / exclude leave it none.
NO_RECOMPUTE_PLAN = (
    "strategy 'auto' plans recompute on the saved tensors the manager takes, and it takes none here, so no "
    "module is recomputed either: lower min_bytes (or exclude less) to let it plan recompute and swaps"
)


# Note [A manager that saw no training step]
# A manager learns of an iteration from the tensors autograd saves for backward. Around a loop that runs only
# under torch.no_grad() or torch.inference_mode() (evaluation, generation) nothing is saved, so it never starts:
# it manages nothing and does not enforce its budget. It says so when it exits, as a BudgetWarning and in the
# report's status, rather than leaving a "not started" that reads like a manager still waiting.
NOT_STARTED = "not started (nothing was saved for backward inside the manager)"


def never_started(grad_enabled: bool) -> str:
    """The warning of a manager that exits having seen no saved tensor (Note [A manager that saw no training
    step]); ``grad_enabled``: autograd was recording when it exited."""
    off = "" if grad_enabled else " (autograd was off when it exited)"
    return (
        "the manager exited without seeing a tensor saved for backward, so it managed nothing and did not enforce "
        f"the budget: the code inside ran without autograd recording{off}, under torch.no_grad() or "
        "torch.inference_mode() (evaluation, generation), or ran no training step. Enter it around the training "
        "loop (forward and backward); a loop without backward needs no manager"
    )


class Notices:
    """The notes of one manager (``notes``, in order) and the causes it has warned about."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self._warned: set[Any] = set()
        self._quoted: dict[Any, tuple[int, str]] = {}  # cause -> (peak, its note): Note [The figure a warning quotes]

    def warn(self, cause: Any, message: str) -> None:
        """A ``BudgetWarning``, once per cause; also kept in the report's notes."""
        if cause in self._warned:
            return
        self._warned.add(cause)
        self.notes.append(message)
        warnings.warn(f"swap: {message}", BudgetWarning, stacklevel=3)

    def note(self, message: str) -> None:
        log.info("swap: %s", message)
        if message not in self.notes:
            self.notes.append(message)

    def nothing_to_move(self, hooks: SavedTensorHooks, budget: int, seq: Optional[Sequence], peak: int,
                        joint: bool = False) -> bool:  # fmt: skip
        """BudgetWarning when the manager cannot move what the budget needs moved, naming the cause: Note
        [Nothing to move, over the budget]. ``hooks``: what they left alone; ``seq``: the profiled sequence
        (None: nothing was recorded, or a later iteration); ``peak``: the highest memory measured; ``joint``:
        ``strategy="auto"`` is on (its recompute plans from the same saved tensors). True when the condition
        holds (warned now or before)."""
        skipped = {k: v for k, v in hooks.profile_skips.items() if v[1] > 0}
        movable = 0 if seq is None else sum(b for b, s in zip(seq.sizes, seq.swappable) if s)
        others = hooks.other_devices
        if others and (seq is None or not seq.sizes):
            self.warn("device", (
                f"saved tensors were on {', '.join(sorted(others))}, none on the manager's device "
                f"{hooks.device}: nothing is managed and the budget is not enforced; pass "
                f"device={sorted(others)[0]!r}"
            ))  # fmt: skip
            return True
        if movable > 0 or peak <= budget:
            return False
        reasons = {
            "min_bytes": f"smaller than min_bytes={hooks.min_bytes} (lower min_bytes)",
            "exclude": "matched by exclude= (exclude less)",
            "parameter": "parameters or views of them (they are not activations)",
            "expanded": "expanded (stride-0) views",
        }
        causes = [f"{n} saved tensor(s), {fmt_bytes(b)}, {reasons[k]}" for k, (n, b) in skipped.items()]
        if seq is not None and seq.sizes:
            causes.append(f"{len(seq.sizes)} saved storage(s), {fmt_bytes(sum(seq.sizes))}, stay alive elsewhere "
                          "(referenced outside autograd, so moving them frees nothing)")  # fmt: skip
        cause = next((k for k in ("min_bytes", "exclude") if k in skipped), "nothing")
        why = ("per iteration, " + "; ".join(causes) if causes else "no tensor was saved for backward inside the "
               "manager") + (f". {NO_RECOMPUTE_PLAN}" if joint and causes else "")  # fmt: skip
        self._quote(cause, peak, lambda grew: (
            f"nothing can be swapped, and the run reaches {fmt_bytes(peak)} {grew}, over the budget of "
            f"{fmt_bytes(budget)}: {why}"
        ))  # fmt: skip
        return True

    def _quote(self, cause: Any, peak: int, message: Callable[[str], str]) -> None:
        """Warns about ``cause`` quoting ``peak``; once more, with its note replaced, when a later ``peak`` is well
        above the figure warned (Note [The figure a warning quotes])."""
        quoted = self._quoted.get(cause)
        if quoted is None:
            text = message("so far (the highest measured yet; the optimizer's state, made at its first step, "
                           "adds to later iterations)")  # fmt: skip
            self.warn(cause, text)
            self._quoted[cause] = (peak, text)
            return
        warned, old = quoted
        if peak <= warned * (1 + REWARN_ABOVE) or (cause, "grew") in self._warned or old not in self.notes:
            return
        text = message(f"(more than the {fmt_bytes(warned)} warned before: a later iteration held more, such as "
                       "the optimizer's state or gradients made since)")  # fmt: skip
        self.notes[self.notes.index(old)] = text
        self._quoted[cause] = (peak, text)
        self._warned.add((cause, "grew"))
        warnings.warn(f"swap: {text}", BudgetWarning, stacklevel=3)
