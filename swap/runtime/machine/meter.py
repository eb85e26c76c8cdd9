"""LiveBytesMeter: bytes of live tensor storage on one device, counted from the outside.

A TorchDispatchMode sees every tensor an operator returns; each new storage on the device is counted until
its Python object dies (PyTorch keeps one Python object per storage for its whole life, so a weak reference
to it ends exactly when the memory is freed). Tensors made before the meter started are added with
``track`` or ``track_existing``. It is independent of the swap manager: tests use it to check the budget.

Note [What the meter cannot see]
The meter counts storages an operator *returns*; memory an operator allocates and frees inside itself
(a convolution's workspace, ``convolution_backward``'s buffers) never reaches Python. Its peak is the
peak of live tensor bytes *between* operators, a lower bound on the allocator's peak. On a GPU the swap
runtime reads the allocator's own peak instead, which is the truth.

Note [Meter and torch.compile]
``ignore_compile_internals`` is True: torch.compile does not fall back to eager because of the meter
(it would, for any other dispatch mode, silently); the meter is off while compiling and on while the
compiled code runs, so compiled graphs' outputs and buffers are counted like eager ones.

Note [Wrapper subclasses]
A wrapper tensor subclass (DTensor: FSDP2's parameters, gradients and optimizer state) owns no memory: its
storage is a stand-in of the *global* size, and its data lives in inner tensors (a DTensor's local shard). The
subclass runs its operators on those inner tensors from inside the meter's own dispatch, where the meter is
off. So for a subclass output the meter counts its inner tensors (``__tensor_flatten__``), never the wrapper.

Note [Storages that resize]
FSDP2 frees an all-gathered (unsharded) parameter by ``untyped_storage().resize_(0)`` and allocates it again
with ``resize_(nbytes)``: the storage object lives on, so counting it until it dies would hold every block's
unsharded parameters for the whole run. ``resize_`` is a storage method that no dispatch mode sees, so while a
meter is active ``torch.UntypedStorage.resize_`` is wrapped (once, however many meters are active; restored
when the last one exits) to tell every active meter the storage's new size: a counted storage's bytes follow
it, and one not counted yet is counted when it grows. Not followed: a storage grown inside an operator that writes
its argument (``aten.resize_``, an ``out=`` tensor too small), counted at the size it had when first seen
(tests/swap/test_sweep_meter.py shows it; re-reading after every mutating operator changed what the CPU
budget tests measure after other tests had run, and is not done yet).
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

try:  # fake tensors are the compiler's, never memory on a device
    from torch._subclasses.fake_tensor import FakeTensor
except ImportError:  # pragma: no cover - every supported torch has it
    FakeTensor = ()  # type: ignore[assignment,misc]


_resize_lock = threading.Lock()
_resizing: list[LiveBytesMeter] = []  # active meters (Note [Storages that resize])
_plain_resize: Any = None  # torch's own ``UntypedStorage.resize_`` while it is wrapped


def _tracked_resize(storage: Any, size: int) -> Any:
    out = _plain_resize(storage, size)
    for meter in list(_resizing):
        meter.resized(storage)
    return out


def _watch_resizes(meter: LiveBytesMeter) -> None:
    global _plain_resize
    with _resize_lock:
        if not _resizing:
            _plain_resize = torch.UntypedStorage.resize_
            torch.UntypedStorage.resize_ = _tracked_resize
        _resizing.append(meter)


def _unwatch_resizes(meter: LiveBytesMeter) -> None:
    global _plain_resize
    with _resize_lock:
        if meter in _resizing:
            _resizing.remove(meter)
            if not _resizing:
                torch.UntypedStorage.resize_ = _plain_resize
                _plain_resize = None


class LiveBytesMeter(TorchDispatchMode):
    """Live tensor bytes on ``device``: ``live`` now, ``peak`` overall, ``window_peak`` since ``reset_window``.

    ``shadow`` is a signed count of bytes the owner asks to add to ``live`` for a second peak,
    ``shadow_window_peak`` (the swap runtime adds the saved tensors it moved off the device, so that this
    peak is what the run would have reached without swapping); ``held`` likewise for a third,
    ``held_window_peak`` (tensors freed during a step that a planned run would still hold)."""

    def __init__(self, device: Any = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.live = 0
        self.peak = 0
        self.window_peak = 0  # peak since the last reset_window()
        self.shadow = 0
        self.shadow_window_peak = 0
        self.held = 0
        self.held_window_peak = 0
        self._seen: dict[int, weakref.ref] = {}  # id(storage) -> weak reference (whose callback uncounts it)
        self._sizes: dict[weakref.ref, tuple[int, int]] = {}  # weak reference -> (id, bytes)
        # Reentrant: a weakref callback (_died) can run inside _add's critical section when the allocations
        # there trigger a GC that collects a counted storage (with a plain Lock that deadlocked a Lightning test).
        self._lock = threading.RLock()
        self._type = self.device.type
        self._index = self.device.index

    def storage_bytes(self, nbytes: int) -> int:
        """What a storage of ``nbytes`` counts: its bytes (a subclass models an allocator's rounding)."""
        return nbytes

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # Note [Meter and torch.compile]

    def _add(self, t: Any) -> None:
        """Counts ``t``'s storage if it is on the device and not counted yet (the hot path: every output)."""
        if self._index is None:
            if t.device.type != self._type:
                return
        elif t.device != self.device:
            return
        if t.layout != torch.strided or t.is_meta or isinstance(t, FakeTensor):
            return
        if type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t):  # Note [Wrapper subclasses]
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):  # DTensor also lists its device mesh
                    self._add(inner)
            return
        st = t.untyped_storage()
        key = id(st)
        ref = self._seen.get(key)
        if ref is not None and ref() is st:  # already counted (a view, an in-place result): no lock needed
            return
        nbytes = self.storage_bytes(st.nbytes())
        with self._lock:
            ref = weakref.ref(st, self._died)
            self._seen[key] = ref
            self._sizes[ref] = (key, nbytes)
            self._grew(nbytes)

    def _grew(self, nbytes: int) -> None:
        """``live`` grows by ``nbytes`` (negative: shrinks); the peaks follow (under ``_lock``)."""
        live = self.live = self.live + nbytes
        if live > self.window_peak:
            self.window_peak = live
            if live > self.peak:
                self.peak = live
        if live + self.shadow > self.shadow_window_peak:
            self.shadow_window_peak = live + self.shadow
        if live + self.held > self.held_window_peak:
            self.held_window_peak = live + self.held

    def resized(self, st: Any) -> None:
        """``st`` (an untyped storage) was resized in place (Note [Wrapper subclasses]
A wrapper tensor subclass (DTensor: FSDP2's parameters, gradients and optimizer state) owns no memory: its
storage is a stand-in of the *global* size, and its data lives in inner tensors (a DTensor's local shard). The
subclass runs its operators on those inner tensors from inside the meter's own dispatch, where the meter is
off. So for a subclass output the meter counts its inner tensors (``__tensor_flatten__``), never the wrapper.

Note [Storages that resize])."""
        dev = st.device
        if dev.type != self._type or (self._index is not None and dev != self.device):
            return
        key = id(st)
        with self._lock:
            ref = self._seen.get(key)
            if ref is None or ref() is not st:
                if st.nbytes() == 0:
                    return
                ref = weakref.ref(st, self._died)
                self._seen[key] = ref
                self._sizes[ref] = (key, 0)
            nbytes = self.storage_bytes(st.nbytes())
            self._grew(nbytes - self._sizes[ref][1])
            self._sizes[ref] = (key, nbytes)

    def __enter__(self) -> LiveBytesMeter:
        _watch_resizes(self)
        try:
            return super().__enter__()
        except BaseException:
            _unwatch_resizes(self)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _unwatch_resizes(self)

    def _died(self, ref: weakref.ref) -> None:
        with self._lock:
            key, nbytes = self._sizes.pop(ref, (None, 0))
            if self._seen.get(key) is ref:
                del self._seen[key]
            self.live -= nbytes

    def add_shadow(self, nbytes: int) -> None:
        """Adds (or, negative, removes) bytes counted in ``shadow_window_peak`` but not in ``live``.

        It never raises the shadow peak by itself: the owner adds bytes exactly when a storage it accounts
        for dies (``live`` drops by as much, in a callback that may run just after this one)."""
        with self._lock:
            self.shadow += nbytes

    def add_held(self, nbytes: int) -> None:
        """Adds bytes counted in ``held_window_peak`` but not in ``live`` (like ``add_shadow``)."""
        with self._lock:
            self.held += nbytes

    def track(self, tensors: Iterable[torch.Tensor]) -> LiveBytesMeter:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return self

    def track_existing(self) -> LiveBytesMeter:
        """Counts every tensor on the device that Python can reach now (parameters, optimizer state, data).

        Tensors the compiler keeps (fake tensors, meta tensors) are not memory on the device and are skipped,
        and so are objects that cannot be inspected (dead weak proxies)."""
        tensors = []
        with warnings.catch_warnings():  # isinstance() pokes deprecated module attributes
            warnings.simplefilter("ignore")
            for o in gc.get_objects():
                try:
                    if isinstance(o, torch.Tensor):
                        tensors.append(o)
                except ReferenceError:  # a weakref.proxy whose referent died
                    continue
        return self.track(tensors)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.live

    def reset_window(self) -> int:
        """Returns the peak since the last call and starts a new window at the current live bytes."""
        with self._lock:
            p, self.window_peak = self.window_peak, self.live
            return p

    def reset_held_window(self) -> int:
        """Returns the held peak since the last call; starts a new window with no held bytes."""
        with self._lock:
            p = self.held_window_peak
            self.held, self.held_window_peak = 0, self.live
            return p

    def reset_shadow_window(self) -> int:
        """Returns the shadow peak since the last call and starts a new window."""
        with self._lock:
            p, self.shadow_window_peak = self.shadow_window_peak, self.live + self.shadow
            return p

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        out = func(*args, **kwargs) if kwargs else func(*args)
        if isinstance(out, torch.Tensor):
            self._add(out)
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    self._add(t)
                elif isinstance(t, (tuple, list)):
                    for u in t:
                        if isinstance(u, torch.Tensor):
                            self._add(u)
        return out
