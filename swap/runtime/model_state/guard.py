"""The parameter guard: no operator ever reads a dropped parameter, and no write to one is lost.

Note [Parameter guard]
A streamed parameter's device storage is empty between uses (Note [Device copies by storage resize]); an operator
that read it then would fail, or read freed memory. Module forward pre-hooks fetch the parameters a module owns
before it runs, and the saved-tensor hooks fetch those backward reads, which covers the usual model; but a
parameter read outside its module (a tied embedding used as the output projection in the parent's forward, a
user's ``p.norm()`` for logging, ``model.load_state_dict``) has no such hook. So a dispatch mode watches every
operator's tensor arguments while the manager runs: one that aliases a watched storage which is dropped is
fetched before the operator runs (a *demand fetch*, counted, and recorded so the next iteration fetches it ahead),
and one the operator writes marks its entry dirty, so its drop copies it back instead of losing the write. The
runtime's own operators (copies) run inside ``busy()``, which the guard lets through. Like the meter it
sees operators between autograd and the kernels, so backward's operators pass through it too (most read
parameters through saved tensors, which the saved-tensor hooks have fetched already; Note [Reads of weights in
flight] covers those that do not).

Note [Reads of weights in flight]
A fetch only *starts* a bucket's copy to the device: the compute stream waits for it (``Masters.ready``, a
device-side wait) at the bucket's next *use*. A prefetch (the streamer's look-ahead, the executor's window) makes
the weights current before any use, so an operator that reads them without a use of its own in between would run
before the copy has landed and read whatever the fresh allocation held, with nothing on the CPU to show it (a host
engine's copies land long before). Such reads are real: the backward of a checkpointed region (the manager's
recompute regions, a user's ``torch.utils.checkpoint``) reruns the region's operators and reads its weights through
the checkpoint's own saved tensors, and a custom ``autograd.Function`` may keep a weight on ``ctx``. Only the
backward reads early there, so the step's losses are right and its gradients, and the update, are not (the symptom
of the GPU bench's model-state run that was not bitwise its oracle). So the guard makes every operator that touches
a watched storage that is not dropped wait for that entry's copy in flight, if any (``ready``: a no-op once it was
waited for, device-side otherwise), as a use would. tests/swap/model_state/test_ms_late_copies.py holds this with
copies made as late as they may be.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..auto.op_facts import written_args


class ParamGuard(TorchDispatchMode):
    """Calls ``demand(key)`` before an operator reads a dropped watched storage (``dropped(key)`` says which are),
    ``ready(key)`` before one touches a watched storage that is not dropped (its copy in flight waited for: Note
    [Reads of weights in flight]) and ``wrote(key)`` after one writes a watched storage; ``watched`` maps storage
    identities (``_cdata``) to whatever the caller keys entries by."""

    def __init__(self, watched: dict[int, Any], dropped: Callable[[Any], bool], demand: Callable[[Any], None],
                 wrote: Callable[[Any], None], ready: Callable[[Any], None] = lambda key: None) -> None:  # fmt: skip
        super().__init__()
        self.watched = watched
        self.dropped = dropped
        self.demand = demand
        self.wrote = wrote
        self.ready = ready
        self._local = threading.local()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # Note [Meter and torch.compile] in swap.runtime.machine.meter

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """The runtime's own operators: let through unwatched."""
        local = self._local
        local.depth = getattr(local, "depth", 0) + 1
        try:
            yield
        finally:
            local.depth -= 1

    def _hits(self, values: Any, hits: list[Any]) -> None:
        watched = self.watched
        for a in values:
            if isinstance(a, torch.Tensor):
                try:
                    key = watched.get(a.untyped_storage()._cdata)
                except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
                    continue
                if key is not None and key not in hits:
                    hits.append(key)
            elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
                self._hits(a, hits)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        if getattr(self._local, "depth", 0):
            return func(*args, **kwargs)
        hits: list[Any] = []
        self._hits(args, hits)
        if kwargs:
            self._hits(kwargs.values(), hits)
        if not hits:
            return func(*args, **kwargs)
        for key in hits:
            if self.dropped(key):
                self.demand(key)
            else:  # Note [Reads of weights in flight]
                self.ready(key)
        out = func(*args, **kwargs)
        written = written_args(func, args, kwargs)
        if written:
            for t in written:
                key = self.watched.get(t.untyped_storage()._cdata)
                if key is not None:
                    self.wrote(key)
        return out
