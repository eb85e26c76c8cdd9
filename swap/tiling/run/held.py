"""What a training step holds on the device that a model's graph does not show: its parameters' gradients kept
from before the forward, and its optimizer's state.

Note [What the step holds besides the graph]
The tiling planner prices the step from the model's graph: parameters, activations, their gradients, and the
parameters' gradients from their backward on (Note [The eager memory model] in swap/tiling/plan/memory.py).
Two more things are live on the device in a training loop, and a plan that leaves them out runs over its
budget by their size (a VGG-style CNN with SGD and momentum went 13 % over, by the momentum buffers):
- the optimizer's state (momentum, Adam's moments), made by its first step and live ever after;
- gradients kept from the iteration before (``zero_grad(set_to_none=False)``, or accumulation over steps).
Neither can be read off the model: optimizers hold their state apart, and nothing links a parameter to its
optimizer. So every tiled model registers with one global optimizer step hook, which records, for each
optimizer that steps any of its parameters, the bytes of that optimizer's state for them on the model's
device (and looks once, when the model is tiled, at the optimizers that exist already); the gradients are
read at each call. A call whose held bytes grew past what its plan assumed is
planned again (swap.tiling.run.model): the first iteration's step makes the state, so the second iteration
and every later one are planned with it. The user's ``extra`` is added on top, for what neither shows (the
caller's own tensors).
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from typing import Any, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

_lock = threading.Lock()
_watchers: weakref.WeakSet = weakref.WeakSet()
_handle: Optional[Any] = None


def _storage_bytes(tensors: list[torch.Tensor], device: Optional[torch.device]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if device is not None and t.device != device:
            continue
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for w in list(_watchers):
        w.stepped(optimizer)


class HeldState:
    """The bytes a training step of a model with ``params`` holds beyond its graph (Note [What the step holds
    besides the graph]): ``bytes()``, read at each call."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = [weakref.ref(p) for p in params]
        self._ids = {id(p) for p in params}
        self._device = params[0].device if params else None
        self._state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> bytes of its state
        global _handle
        with _lock:
            _watchers.add(self)
            if _handle is None:
                _handle = register_optimizer_step_post_hook(_after_step)
        with warnings.catch_warnings():  # isinstance() pokes deprecated module attributes
            warnings.simplefilter("ignore")
            found = [o for o in gc.get_objects() if isinstance(o, torch.optim.Optimizer)]
        for o in found:  # optimizers that stepped before this model was tiled
            self.stepped(o)

    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` took a step: record its state's bytes for our parameters, if it steps any."""
        mine = [p for g in optimizer.param_groups for p in g["params"] if id(p) in self._ids]
        if not mine:
            return
        tensors = [v for p in mine for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        self._state[optimizer] = _storage_bytes(tensors, self._device)

    def bytes(self) -> int:
        """Optimizer state of our parameters plus the gradients they hold now, on the parameters' device."""
        grads = [g for r in self.params if (p := r()) is not None and (g := p.grad) is not None]
        return sum(self._state.values()) + _storage_bytes(grads, self._device)
