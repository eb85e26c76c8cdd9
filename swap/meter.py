"""LiveBytesMeter: bytes of live tensor storage on one device, counted from the outside.

A TorchDispatchMode sees every tensor an operator returns; each new storage on the device is counted until
its Python object dies (PyTorch keeps one Python object per storage for its whole life, so a weak reference
to it ends exactly when the memory is freed). Tensors made before the meter started are added with
``track`` or ``track_existing``. It is independent of the swap manager: tests use it to check the budget.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytesMeter(TorchDispatchMode):
    def __init__(self, device: Any = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.live = 0
        self.peak = 0
        self.window_peak = 0  # peak since the last reset_window()
        self._seen: dict[int, weakref.ref] = {}
        self._lock = threading.RLock()  # a weakref callback (_sub) can run inside _add: GC during it

    def _on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device.type and (self.device.index is None or t.device == self.device)

    def _add(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or not self._on_device(t) or t.layout != torch.strided:
            return
        st = t.untyped_storage()
        key = id(st)
        with self._lock:
            ref = self._seen.get(key)
            if ref is not None and ref() is st:
                return
            nbytes = st.nbytes()
            self._seen[key] = weakref.ref(st, lambda _r, k=key, n=nbytes: self._sub(k, n))
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            self.window_peak = max(self.window_peak, self.live)

    def _sub(self, key: int, nbytes: int) -> None:
        with self._lock:
            self._seen.pop(key, None)
            self.live -= nbytes

    def track(self, tensors: Iterable[torch.Tensor]) -> LiveBytesMeter:
        for t in tensors:
            self._add(t)
        return self

    def track_existing(self) -> LiveBytesMeter:
        """Counts every tensor on the device that Python can reach now (parameters, optimizer state, data)."""
        with warnings.catch_warnings():  # isinstance() pokes deprecated module attributes
            warnings.simplefilter("ignore")
            tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        return self.track(tensors)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.live

    def reset_window(self) -> int:
        """Returns the peak since the last call and starts a new window at the current live bytes."""
        with self._lock:
            p, self.window_peak = self.window_peak, self.live
            return p

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._add(t)
        return out
