"""Gradients of offloaded parameters: copied off the device as autograd makes them, accumulated on the host.

Note [Gradients on the host]
A post-accumulate-grad hook on each managed parameter takes ``p.grad`` the moment autograd has made it, starts its
copy to the parameter's host gradient buffer on the D2H lane, and sets ``p.grad = None``: the device memory goes
once the copy has landed, and the user's optimizer skips the parameter (it steps only those with a gradient). The
first backward pass of an optimizer step copies; a later one (gradient accumulation) copies to a staging buffer (a
pool of a fixed, predicted size: a copy waits for earlier adds when it is full) and adds it to the host buffer,
the same IEEE addition in the same order as autograd's ``grad += new``, so the result is bitwise plain torch's.
``zero_grad`` resets the host buffers as it would ``p.grad``: ``set_to_none`` forgets them (the next backward
copies), otherwise they are zeroed (the next one adds to zero, as torch does). Without a ``zero_grad`` gradients
accumulate across steps, as in torch. The host work runs on a lane of its own (one thread), so a gradient never
lands behind a host step (speculative ones run during the backward: Note [Speculative host steps]); a new copy
into a buffer waits for any earlier work on it and for every host step reading its bucket's gradients, and a
zeroing queued on the lane waits for those steps itself.

Note [p.grad of an offloaded parameter]
The loop stays plain torch's: while the manager runs, an offloaded parameter's ``grad`` attribute is its host
gradient. Each such parameter's class is swapped (as torch swaps a lazy parameter's) for a subclass whose ``grad``
property reads and writes the host buffer, so code that reads ``p.grad`` between backward and step (grad-norm
logging, NaN checks, ``clip_grad_value_``, ``GradScaler``) gets the gradient, once every copy and accumulation into
it has landed (and, for a bucket whose host step is pending, after that step, so a write never races it):

- a read gives the host buffer itself, in place: on CPU runs a tensor on the parameter's device; on CUDA runs a
  CPU tensor (``.item()``, norms and CPU scalars mix with device tensors as torch allows; ``p.grad.to(device)``
  for a device copy). None when the parameter has no gradient this step, as in torch;
- an in-place write (``p.grad.mul_``, ``clamp_``, ``zero_``) writes the host buffer, so the host step sees it;
- ``p.grad = None`` forgets the gradient (the next backward starts afresh, as torch's does), and ``p.grad = t``
  makes ``t`` the gradient (copied into the host buffer).

The runtime's own reads and writes, the user's ``opt.step()`` (which must skip offloaded parameters: the host steps
them) and ``zero_grad`` (which resets the buffers itself, without waiting for a host step) see the attribute
torch keeps, which is None. ``type(p)`` is the subclass while the manager runs (``isinstance(p, nn.Parameter)``
holds) and is restored at its exit.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..machine.host_pool import HostBlock, HostPool, HostPoolExhausted
from .buckets import Entry, trains
from .storage import Copies, grad_span, host_tensor

# Buckets of gradients on their way to the host the plan prices (``plan_bytes``' ``in_flight`` in
# swap.schedule.model_state), and so the most the lane may hold (Note [Gradients in flight])
IN_FLIGHT = 2
_RAW = torch._C.TensorBase.grad  # the attribute torch keeps (Note [p.grad of an offloaded parameter])
_sinks: dict[int, GradSink] = {}  # id(parameter) -> the sink holding its host gradient
_classes: dict[type, type] = {}  # a parameter class -> its subclass with the routed ``grad``


def raw_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    """``p.grad`` as torch keeps it (None for an offloaded parameter)."""
    return _RAW.__get__(p)


def set_raw_grad(p: torch.Tensor, g: Optional[torch.Tensor]) -> None:
    _RAW.__set__(p, g)


def _get(p: torch.Tensor) -> Optional[torch.Tensor]:
    sink = _sinks.get(id(p))
    if sink is None or not sink.routes(p):
        return raw_grad(p)
    return sink.read(p)


def _set(p: torch.Tensor, g: Optional[torch.Tensor]) -> None:
    sink = _sinks.get(id(p))
    if sink is None or not sink.routes(p):
        set_raw_grad(p, g)
    else:
        sink.write(p, g)


# Note [Upcast, then add]
# Under mixed precision each accumulating backward's gradient lands in a staging buffer in the compute dtype and
# the lane adds it to the fp32 host gradient. ``host.add_(staged)`` with the two dtypes takes TensorIterator's
# dynamic-casting loop on the CPU, element by element and unvectorised: 85 ms for 16 M elements (bf16 into fp32,
# one thread, torch 2.13), against 11.5 ms to upcast (``copy_``) and 14 ms for an fp32 ``add_``. The lane is one
# thread and the backward waits for it once the gradients in flight reach their cap (Note [Gradients in
# flight]), so at 1.1 B parameters that loop alone was seconds of every accumulating micro-batch. So the staged
# gradient is upcast a chunk at a time into a small fp32 scratch (CHUNK elements, 1 MiB, the lane's own,
# reused) and added from there: 9.9 ms for the same 16 M elements, and the same bits, since the upcast is exact
# and the mixed loop computes the same fp32 addition on the upcast value (test_ms_grad_upcast.py). Buffers that
# are not contiguous (a parameter that is a strided view) keep the mixed ``add_``.
CHUNK = 1 << 18


def accumulate_upcast(host: torch.Tensor, staged: torch.Tensor,
                      scratch: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:  # fmt: skip
    """``host += staged`` with ``staged`` in another (narrower) floating dtype, bitwise ``host.add_(staged)``,
    upcast a chunk at a time into ``scratch`` (made if None or too small; returned for reuse): Note [Upcast, then
    add]."""
    if staged.dtype == host.dtype or not (host.is_contiguous() and staged.is_contiguous()) or \
            host.shape != staged.shape:  # fmt: skip
        host.add_(staged)
        return scratch
    n = host.numel()
    chunk = min(n, CHUNK)
    if scratch is None or scratch.dtype != host.dtype or scratch.numel() < chunk:
        with _disable_current_modes():  # host memory: unseen by a meter (Note [Host pool on CPU runs])
            scratch = torch.empty(max(chunk, CHUNK), dtype=host.dtype, device=host.device)
    dst, src = host.view(-1), staged.view(-1)
    for i in range(0, n, chunk):
        m = min(chunk, n - i)
        up = scratch[:m]
        up.copy_(src[i : i + m])
        dst[i : i + m].add_(up)
    return scratch


def _routed_class(cls: type) -> type:
    sub = _classes.get(cls)
    if sub is None:
        sub = _classes[cls] = type(cls.__name__, (cls,), {"grad": property(_get, _set, doc=_RAW.__doc__),
                                                          "__module__": cls.__module__})  # fmt: skip
    return sub


class GradSink:
    """The host gradient buffers of ``entries``' parameters (from ``pool``; accumulation staging from ``staging``),
    filled over ``engine`` with the copies' host work on ``worker`` (a lane of its own: a gradient lands without
    waiting behind host steps). ``gate(entry)`` waits until no host step reads the entry's bucket's gradients;
    ``reading(entry)``: the host steps that may read them now; ``in_backward()`` is told when a gradient arrives (a
    backward pass runs), ``arrived(p)`` once ``p``'s copy is under way. ``bucket_bytes``: the largest a bucket
    packs (Note [Gradients in flight]: at most ``IN_FLIGHT`` times that, or the largest gradient's, in flight)."""

    def __init__(self, entries: list[Entry], pool: HostPool, staging: HostPool, engine: Any,
                 worker: ThreadPoolExecutor, gate: Callable[[int], None], in_backward: Callable[[], None],
                 copies: Copies, busy: Callable[[], Any],
                 arrived: Callable[[torch.nn.Parameter], None] = lambda p: None,
                 reading: Callable[[int], list[Future]] = lambda entry: [], bucket_bytes: int = 0,
                 fits: Callable[[int], bool] = lambda nbytes: True) -> None:  # fmt: skip
        self.fits = fits  # Note [Gradients in flight keep the budget]
        self.pool, self.staging, self.engine, self.worker = pool, staging, engine, worker
        self.gate, self.in_backward, self.copies, self.busy = gate, in_backward, copies, busy
        self.arrived, self.reading = arrived, reading
        self.lock = threading.Lock()
        # Frozen parameters have no gradient buffer (Note [Frozen parameters] in swap.runtime.model_state.buckets).
        self.params = [p for e in entries for _, p in e.params if trains(p)]
        # Whose weights and gradients live on the host (not resident ones), frozen ones included: a state dict
        # gives their host masters.
        self.offloaded = {id(p) for e in entries for _, p in e.params}
        self.entry_of = {id(p): e.index for e in entries for _, p in e.params}
        self.blocks: dict[int, HostBlock] = {}
        self.host: dict[int, torch.Tensor] = {}  # id(p) -> host gradient buffer
        self.has: dict[int, bool] = {}  # id(p) -> the buffer holds this step's gradient so far
        self.tasks: dict[int, Future] = {}  # id(p) -> the last host work on its buffer
        # id(p) -> writes made to its buffer, or reads that handed it out (Note [Speculative host steps])
        self.writes: dict[int, int] = {}
        self._handles: list[Any] = []
        self._local = threading.local()  # depth of ``raw()`` on this thread
        self.stepping = False  # the user's opt.step() runs: it must see torch's attribute
        self.compute_dtype: Optional[torch.dtype] = None  # Note [Mixed precision]: the gradients arriving
        self._swapped: list[tuple[torch.nn.Parameter, type]] = []
        # Note [Gradients in flight]: (the lane's work holding a device gradient, its bytes), oldest first
        largest = max((e.nbytes for e in entries), default=0)  # a bucket's gradients are at most its weights
        self.cap = IN_FLIGHT * max(bucket_bytes, largest)
        self.flying: deque[tuple[Future, int]] = deque()
        self.flying_bytes = 0
        self._scratch: Optional[torch.Tensor] = None  # the lane's upcast chunk (Note [Upcast, then add])

    def allocate(self) -> None:
        """A host gradient buffer for every parameter, in its master's dtype (fp32 under Note [Mixed precision]:
        called while the parameters still have it)."""
        for p in self.params:
            self.blocks[id(p)] = block = self.pool.alloc(grad_span(p))
            self.host[id(p)] = host_tensor(block.view, p, 0)
            self.has[id(p)] = False

    def host_bytes(self) -> int:
        return sum(b.size for b in self.blocks.values())

    def install(self) -> None:
        for p in self.params:
            self._handles.append(p.register_post_accumulate_grad_hook(self._arrived))
            if raw_grad(p) is not None:  # made before the manager started: it moves to the host too
                self.take(p)
        for p in self.params:  # Note [p.grad of an offloaded parameter]
            self._swapped.append((p, type(p)))
            _sinks[id(p)] = self
            p.__class__ = _routed_class(type(p))

    def uninstall(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for p, cls in self._swapped:
            p.__class__ = cls
            if _sinks.get(id(p)) is self:
                del _sinks[id(p)]
        self._swapped = []

    # -- p.grad (Note [p.grad of an offloaded parameter]) ---------------------------------------------------
    @contextlib.contextmanager
    def raw(self) -> Iterator[None]:
        """Inside, ``p.grad`` is torch's attribute on this thread."""
        local = self._local
        local.depth = getattr(local, "depth", 0) + 1
        try:
            yield
        finally:
            local.depth -= 1

    def routes(self, p: torch.Tensor) -> bool:
        """Whether ``p.grad`` is ``p``'s host gradient now."""
        return id(p) in self.offloaded and not self.stepping and not getattr(self._local, "depth", 0)

    def _ready(self, k: int) -> None:
        """Every copy into ``k``'s buffer landed, and its bucket's pending host step done."""
        self.gate(self.entry_of[k])
        with self.lock:
            task = self.tasks.get(k)
        if task is not None:
            task.result()

    def read(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        k = id(p)
        self._ready(k)
        self._wrote(k)  # the reader holds the buffer: a write no counter sees may follow
        return self.host[k] if self.has.get(k) else None

    def _wrote(self, k: int) -> None:
        with self.lock:
            self.writes[k] = self.writes.get(k, 0) + 1

    def touch(self, params: Any) -> None:
        """``params``' host gradients were written in place (clipping, unscaling: Note [Speculative host steps])."""
        for p in params:
            self._wrote(id(p))

    def signature(self, p: torch.Tensor) -> tuple[bool, int, int]:
        """What tells whether ``p``'s host gradient changed (Note [Speculative host steps])."""
        k = id(p)
        with self.lock:
            host = self.host.get(k)
            return bool(self.has.get(k)), self.writes.get(k, 0), 0 if host is None else host._version

    def landing(self, p: torch.Tensor) -> Optional[Future]:
        """The last host work on ``p``'s buffer (its copy, an accumulation), if any."""
        with self.lock:
            return self.tasks.get(id(p))

    def write(self, p: torch.Tensor, g: Optional[torch.Tensor]) -> None:
        k = id(p)
        self._wrote(k)
        if g is None:  # as zero_grad(set_to_none=True): the next copy waits for any work on the buffer
            with self.lock:
                self.has[k] = False
            return
        self._ready(k)
        host = self.host[k]  # the master's dtype (Note [Mixed precision]), which is the parameter's otherwise
        if g.shape != p.shape or g.dtype != host.dtype:
            raise RuntimeError(f"assigned grad has shape {tuple(g.shape)} and dtype {g.dtype}, the parameter's "
                               f"gradient {tuple(p.shape)} and {host.dtype}")  # fmt: skip
        with self.busy(), torch.no_grad(), _disable_current_modes():  # Note [Host operators unseen] (clipping)
            self.host[k].copy_(g)
        self.has[k] = True

    # -- gradients arriving -----------------------------------------------------------------------------
    def _arrived(self, p: torch.nn.Parameter) -> None:
        self.stepping = False  # a step that raised never reached its post-hook
        self.in_backward()
        if id(p) in self.offloaded:
            self.take(p)
            self.arrived(p)

    def take(self, p: torch.nn.Parameter) -> None:
        """Note [Gradients on the host]."""
        g = raw_grad(p)
        if g is None:
            return
        set_raw_grad(p, None)
        k = id(p)
        self.gate(self.entry_of[k])
        with self.lock, self.busy():
            self.writes[k] = self.writes.get(k, 0) + 1
            host = self.host[k]
            earlier = self.tasks.get(k)
            if self.has[k] or g.dtype != host.dtype:  # accumulated, or upcast (Note [Mixed precision])
                block = self._staging_block(grad_span(p, g.dtype))
                staged = host_tensor(block.view, p, 0, g.dtype)
                ticket = self.engine.d2h(staged, g)
                nbytes = g.numel() * g.element_size()
                if not self.has[k] and earlier is not None:
                    self._wait_unlocked([earlier], quiet=False)  # nothing else may be writing the buffer
                box = self._hand_over(ticket, g, nbytes)
                task = self.worker.submit(self._add, ticket, box, host, staged, block, self.has[k])
                self.tasks[k] = task
                self._flying(task, box, nbytes)
                self.has[k] = True
            else:
                if earlier is not None:
                    self._wait_unlocked([earlier], quiet=False)  # nothing else may be writing the buffer
                ticket = self.engine.d2h(host, g)
                nbytes = g.numel() * g.element_size()
                box = self._hand_over(ticket, g, nbytes)
                if not box:  # copied already (a small copy runs inline): nothing to wait for
                    self.tasks.pop(k, None)
                else:
                    self.tasks[k] = task = self.worker.submit(self._landed, ticket, box)
                    self._flying(task, box, nbytes)
                self.has[k] = True
            self.copies.grads_out += nbytes

    def _staging_block(self, nbytes: int) -> HostBlock:
        """A staging buffer, within the staging pool's predicted size: when it is full, the adds in flight finish
        and free theirs first (Note [Host memory before allocating])."""
        try:
            return self.staging.alloc(nbytes)
        except HostPoolExhausted:
            self._wait_unlocked(list(self.tasks.values()), quiet=False)
            return self.staging.alloc(nbytes)

    # Note [Waiting for the lane outside the lock]
    # ``take`` runs under the sink's lock, and a speculative host step reads the gradients' signatures under it
    # (Note [Speculative host steps]), while a zeroing that ``zero_grad(set_to_none=False)`` queued on the lane
    # waits for the speculations reading its buffer. So ``take`` waiting for the lane with the lock held (a staging
    # buffer to free, a gradient in flight to land, the last work on its own buffer) deadlocked whenever a
    # zeroing ahead on the lane waited for a speculation that had not yet read its signatures: two backward passes
    # over one forward with ``zero_grad(set_to_none=False)`` between them, a host slow to start the speculations
    # (test_ms_zero_grad_lock). Every such wait lets go of the lock while it waits: only this thread changes what
    # the lock guards in the meantime (the lane's work and the speculations take no part of it).
    def _wait_unlocked(self, tasks: list[Future], quiet: bool = True) -> None:
        """Waits for ``tasks`` without the sink's lock, which the caller holds (Note [Waiting for the lane outside
        the lock]); ``quiet``: a task's error is left to whoever waits for its buffer (settle, a read)."""
        self.lock.release()
        try:
            for t in tasks:
                try:
                    t.result()
                except Exception:
                    if not quiet:
                        raise
        finally:
            self.lock.acquire()

    # Note [Gradients in flight keep the budget]
    # A gradient whose copy is still running when it is handed over stays on the device until the lane lets go of
    # it, while the backward goes on allocating: how long depends on the host's load, not on the model. Measured
    # by the profiling iterations, that made the budget a matter of timing: the 2.6 MB MLP's smallest budget was
    # named 2,689,548 bytes or 2,820,620 depending on the run, a retry at the first was refused at 3.44 MiB with
    # "1.13 MiB held by the backward pass" when the lane lagged, and a declined run went 1 MiB over. So a
    # gradient is left in flight only where ``fits`` (the streamer's prefetch test: what is live now and the
    # largest step's allocation on top keep the budget; never before a profile exists) says the device has room
    # for it; otherwise the gradients already in flight land first, then its own copy, and its memory goes at the
    # same point as an inline copy's. Where the budget is tight, every run frees it at the same operator.
    def _hand_over(self, ticket: Any, g: torch.Tensor, nbytes: int) -> list[torch.Tensor]:
        """A box holding ``g`` for the lane, empty if its copy is done already (it ran inline: the memory goes
        now); else, first, room for its ``nbytes`` among the gradients in flight (Note [Gradients in flight]), and
        on the device (Note [Gradients in flight keep the budget]): without it, its copy is waited for."""
        if self.engine.done(ticket):
            return []
        while self.flying and (self.flying_bytes + nbytes > self.cap or not self.fits(0)):
            task, n = self.flying.popleft()
            self.flying_bytes -= n
            self._wait_unlocked([task])  # Note [Waiting for the lane outside the lock]
        if not self.fits(0):
            self.engine.wait_host(ticket)  # the copy engine's worker takes no lock of ours
            return []
        return [g]

    def _flying(self, task: Future, box: list[torch.Tensor], nbytes: int) -> None:
        """``task`` holds ``box``'s device gradient until it has landed (Note [Gradients in flight])."""
        if box:
            self.flying.append((task, nbytes))
            self.flying_bytes += nbytes
        while self.flying and self.flying[0][0].done():  # the landed ones leave at once (no wait)
            self.flying_bytes -= self.flying.popleft()[1]

    def _landed(self, ticket: Any, box: list[torch.Tensor]) -> None:
        self.engine.wait_host(ticket)
        box.clear()  # the device memory goes only once the copy has read it (Note [Copies without record_stream])

    def _add(self, ticket: Any, box: list[torch.Tensor], host: torch.Tensor, staged: torch.Tensor,
             block: HostBlock, accumulate: bool = True) -> None:  # fmt: skip
        """``host += staged`` (``accumulate``) or ``host = staged``, in ``host``'s dtype (an fp32 buffer upcasts a
        compute-dtype gradient exactly, then adds in fp32), once the copy into ``staged`` has landed (``box``:
        the device gradient, if its copy was still running, let go of then)."""
        self.engine.wait_host(ticket)
        box.clear()
        if accumulate:
            self._scratch = accumulate_upcast(host, staged, self._scratch)
        else:
            host.copy_(staged)
        self.staging.free(block)

    # -- reading and resetting ------------------------------------------------------------------------------
    def settle(self) -> None:
        """Waits until every gradient that has arrived is in its host buffer."""
        with self.lock:
            tasks = list(self.tasks.values())
        for t in tasks:
            t.result()

    def grad(self, p: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """``p``'s host gradient (call ``settle`` first), or None if it has none this step."""
        return self.host[id(p)] if self.has.get(id(p)) else None

    def manages(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient lives in a host buffer (an offloaded parameter's)."""
        return id(p) in self.offloaded

    def to_device(self, p: torch.nn.Parameter, device: torch.device) -> int:
        """``p`` becomes resident: its host gradient (if any) becomes ``p.grad`` again, made on ``device`` where
        the meter sees it; returns the bytes copied in."""
        self.settle()
        self.offloaded.discard(id(p))
        g = self.grad(p)
        self.has[id(p)] = False
        if g is None:
            return 0
        with torch.no_grad():
            set_raw_grad(p, g.to(device, copy=True))
        return g.numel() * g.element_size()

    def zero(self, params: Any, set_to_none: bool) -> None:
        """``zero_grad`` for the managed ones of ``params`` (Note [Gradients on the host])."""
        with self.lock:
            for p in params:
                k = id(p)
                if k not in self.offloaded or not self.has[k]:
                    continue
                self.writes[k] = self.writes.get(k, 0) + 1
                if set_to_none:
                    self.has[k] = False
                else:  # after the host steps reading the buffer (this lane does not wait for them otherwise)
                    self.tasks[k] = self.worker.submit(self._zero, self.host[k], self.reading(self.entry_of[k]))

    @staticmethod
    def _zero(host: torch.Tensor, after: list[Future]) -> None:
        for f in after:
            try:
                f.result()
            except Exception:  # noqa: S110 -- raised to whoever waits for the step
                pass
        host.zero_()

    def close(self) -> None:
        self.settle()
        for block in self.blocks.values():
            self.pool.free(block)
        self.blocks, self.host = {}, {}
