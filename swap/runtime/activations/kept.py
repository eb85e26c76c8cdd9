"""Saved tensors the manager leaves on the device because of ``min_bytes`` or ``exclude``, counted while they
live (the profile's ``kept`` bytes, for diagnosis)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch


class KeptTensors:
    """Live bytes of the kept saved tensors' storages (``bytes``), each counted once until it dies. ``lock``:
    the executor's lock for byte counts that callbacks change."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self.bytes = 0
        self._kept: dict[int, Any] = {}

    def note(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        entry = self._kept.get(key)
        if entry is not None and entry[0]() is st:
            return
        n = st.nbytes()

        def gone(ref: Any, key: int = key, n: int = n) -> None:
            with self.lock:
                if self._kept.get(key, (None,))[0] is ref:
                    del self._kept[key]
                    self.bytes -= n

        with self.lock:
            self._kept[key] = (weakref.ref(st, gone), n)
            self.bytes += n
