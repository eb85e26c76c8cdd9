"""SweepMeter: an independent judge of a CPU budget for tests, sharing no code with the manager's meter.

Note [Sweeping every storage]
The manager measures the CPU budget with its own LiveBytesMeter (swap.runtime.machine.meter), which counts a storage's
bytes once, when an operator first returns it, and follows in-place resizes only through the hooks it installs
(``UntypedStorage.resize_``). A test that judged the manager with that meter would share its blind spots: a
storage resized in place by an operator (``aten.resize_``, ``set_``) or by a path the hook misses is counted
at its old size by both. This meter instead remembers every storage it has ever seen, as an input or an
output of any operator (or alive when ``track_existing`` ran), and after every operator re-reads the size of
each one still alive and adds them up. A storage FSDP2 frees with ``resize_(0)`` counts 0 from the next
operator on, and counts its full size again once the all-gather that refills it has run. It costs a pass over
the live storages per operator: fine for the small models tests train, not for a benchmark.

Like the manager's meter it sees live storages between operators, never memory inside one; wrapper subclasses
(DTensor) count their inner tensors, never the wrapper's stand-in storage.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


class SweepMeter(TorchDispatchMode):
    """Live CPU storage bytes, re-read at every operator (Note [Sweeping every storage]): ``live`` after the last
    operator, ``peak`` overall, ``window_peak`` since ``reset_window``."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.live = self.peak = self.window_peak = 0
        self.sweeps = 0
        self._storages: dict[int, weakref.ref] = {}

    def _note(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.is_meta or t.layout != torch.strided:
            return
        if type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t):
            for name in t.__tensor_flatten__()[0]:
                self._note(getattr(t, name))
            return
        if t.device.type != self.device.type:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor with no storage (fake, functional)
            return
        key = id(st)
        ref = self._storages.get(key)
        if ref is None or ref() is not st:
            self._storages[key] = weakref.ref(st, lambda r, key=key: self._drop(key, r))

    def _drop(self, key: int, ref: weakref.ref) -> None:
        if self._storages.get(key) is ref:
            del self._storages[key]

    def sweep(self) -> int:
        """Adds up the current size of every live storage seen; returns it (and moves the peaks)."""
        total = 0
        for ref in list(self._storages.values()):
            st = ref()
            if st is not None:
                total += st.nbytes()
        self.live = total
        self.window_peak = max(self.window_peak, total)
        self.peak = max(self.peak, total)
        self.sweeps += 1
        return total

    def track_existing(self) -> SweepMeter:
        """Counts every tensor Python can reach now (parameters, optimizer state, data)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for o in gc.get_objects():
                try:
                    if isinstance(o, torch.Tensor):
                        self._note(o)
                except ReferenceError:
                    continue
        self.sweep()
        return self

    def reset_window(self) -> int:
        """The peak since the last call; a new window starts at the bytes live now."""
        p, self.window_peak = self.window_peak, self.sweep()
        return max(p, self.window_peak)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            self._note(t)
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            self._note(t)
        self.sweep()
        return out
