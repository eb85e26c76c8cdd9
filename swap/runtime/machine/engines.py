"""Transfer engines: the D2H and H2D copy lanes, with completion tickets.

``CudaEngine`` copies on one D2H and one H2D stream, each copy fenced by events: a D2H copy waits for the
compute stream's work up to the save; the compute stream waits for an H2D copy only when it uses the
variable. ``HostEngine`` has the same interface with one worker thread per direction and futures, so the
executor's concurrency paths run in tests without a GPU.

Note [Copies without record_stream]
A copy's device operand is allocated on the compute stream and used on a copy stream. The usual way to tell
the allocator is ``Tensor.record_stream(copy_stream)``, which makes the free of the block wait until the
copy stream's work *at free time* is done: the prefetches queued behind the copy delay its reuse, and while
an allocate-to-pool scope is active (``vmalloc.use_mem_pool``, graph capture) torch's caching allocator
holds every such block until the scope ends, so memory grows every iteration. The lifetime is explicit
instead: the caller keeps both operands alive until it has waited for the copy's ticket, on the host
(``wait_host``) or on the compute stream (``wait_compute``), and drops its reference only then. Any later
reuse of the memory is then ordered after the copy on the compute stream, the block's allocation stream,
which is all the allocator needs (the executor keeps to this: swap.runtime.activations.transfers' ``release``,
``ensure_resident``, ``process_dying``; ``drain`` before anything is dropped at exit).

Note [Device-side waits]
Dropping a copy's device operand needs no host wait: ``wait_compute`` makes the compute stream wait for the
copy's event (``Stream.wait_event``, queued on the device, returning at once), so whatever reuses the memory
later on that stream, or on another stream after the allocator's own fence, runs after the copy. Only the host
touching the memory itself (reading a host block on the CPU, unpinning it) needs ``wait_host``
(``cudaEventSynchronize``); the executor's steps never do, so the CPU keeps running ahead of the GPU.
``host_waits`` counts the waits that found a copy still running (the host really waited): 0 on the hot path.
A copy's ``after`` ticket orders it after another copy on the device (the copy stream waits on that copy's
event): a host block is written only after the last copy that read it is done, whichever streams they ran
on (Note [Host block fences] in swap/runtime/activations/transfers.py).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch


class Ticket:
    """One copy in flight."""

    def __init__(self, handle: Any, nbytes: int) -> None:
        self.handle = handle
        self.nbytes = nbytes


class _Bandwidth:
    def __init__(self) -> None:
        self.bytes = 0
        self.seconds = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        self.bytes += nbytes
        self.seconds += seconds

    def rate(self, default: float) -> float:
        return self.bytes / self.seconds if self.seconds > 0 and self.bytes > 0 else default


class HostEngine:
    """Copies on worker threads (one per direction). Waiting blocks the calling thread.

    Copies of at most ``inline_bytes`` run on the calling thread: handing one to a worker (a future, a
    wake-up, the worker taking the GIL back) costs more than the memcpy itself (bench/swap_overhead.py)."""

    def __init__(self, inline_bytes: int = 256 << 10) -> None:
        self.inline_bytes = inline_bytes
        self._d2h = ThreadPoolExecutor(1, thread_name_prefix="swap-d2h")
        self._h2d = ThreadPoolExecutor(1, thread_name_prefix="swap-h2d")
        self.d2h_bw, self.h2d_bw = _Bandwidth(), _Bandwidth()
        self.host_waits = 0  # wait_host calls that blocked (Note [Device-side waits])

    def _copy(self, pool: ThreadPoolExecutor, bw: _Bandwidth, dst: torch.Tensor, src: torch.Tensor,
              after: Optional[Ticket]) -> Ticket:  # fmt: skip
        nbytes = src.numel() * src.element_size()
        if nbytes <= self.inline_bytes:
            self._wait(after)  # the other direction's worker may still use the block
            t0 = time.perf_counter()
            with torch._C._DisableTorchDispatch():  # like the workers' copies, unseen by a meter on this thread
                dst.copy_(src)
            bw.add(nbytes, time.perf_counter() - t0)
            return Ticket(None, nbytes)  # done
        operands = [dst, src]

        def run() -> None:
            # The worker lets go of both tensors before the copy is reported done: a device storage the
            # executor releases after waiting then dies on the executor's thread, at a reproducible point
            # (otherwise the worker's last reference could outlive the wait, and the step's measured peak
            # would depend on thread timing).
            d, s = operands
            operands.clear()
            self._wait(after)  # a copy only ever follows one issued before it: the workers cannot deadlock
            t0 = time.perf_counter()
            d.copy_(s)
            del d, s
            bw.add(nbytes, time.perf_counter() - t0)

        return Ticket(pool.submit(run), nbytes)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, after: Optional[Ticket] = None) -> Ticket:
        """Copies ``src`` (device) into ``dst`` (host) once ``after``'s copy is done."""
        return self._copy(self._d2h, self.d2h_bw, dst, src, after)

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Optional[Ticket] = None) -> Ticket:
        """Copies ``src`` (host) into ``dst`` (device) once ``after``'s copy is done."""
        return self._copy(self._h2d, self.h2d_bw, dst, src, after)

    def done(self, ticket: Ticket) -> bool:
        return ticket.handle is None or ticket.handle.done()

    @staticmethod
    def _wait(ticket: Optional[Ticket]) -> float:
        f: Optional[Future] = None if ticket is None else ticket.handle
        if f is None:
            return 0.0
        if f.done():
            f.result()
            return 0.0
        t0 = time.perf_counter()
        f.result()
        return time.perf_counter() - t0

    def wait_host(self, ticket: Ticket) -> float:
        """Blocks until the copy is done; returns the seconds waited."""
        seconds = self._wait(ticket)
        self.host_waits += seconds > 0
        return seconds

    def wait_compute(self, ticket: Ticket) -> float:
        """The compute "stream" is this thread: it waits for the copy; returns the seconds waited."""
        return self._wait(ticket)

    def measure(self) -> None:
        """Bandwidths are recorded as each copy finishes; nothing to fold in."""

    def drain(self) -> None:
        for pool in (self._d2h, self._h2d):
            pool.submit(lambda: None).result()

    def close(self) -> None:
        self._d2h.shutdown(wait=True)
        self._h2d.shutdown(wait=True)


class CudaEngine:
    """Copies on a D2H and an H2D stream of ``device``; completion is a CUDA event. Both operands of a copy
    must stay referenced until its ticket was waited for (Note [Copies without record_stream])."""

    # Note [Timings folded as they go]
    # Each copy keeps its two timing events until ``measure`` folds them into the bandwidth estimates. The
    # executor measures at every backward pass's end, but a loop without one (evaluation, generation under a
    # manager with model state, whose weight fetches are copies) never does, and the list grew by one entry
    # per copy for the whole loop. So a copy that finds FOLD_AT entries or more folds the finished ones first;
    # the next fold waits until the list has doubled, so a long run of unfinished copies costs amortised O(1)
    # queries per copy.
    FOLD_AT = 256

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h_stream = torch.cuda.Stream(device)
        self.h2d_stream = torch.cuda.Stream(device)
        self.d2h_bw, self.h2d_bw = _Bandwidth(), _Bandwidth()
        self._timed: list[tuple[_Bandwidth, int, torch.cuda.Event, torch.cuda.Event]] = []
        self._fold_at = self.FOLD_AT
        self.host_waits = 0  # wait_host calls that blocked (Note [Device-side waits])

    def _copy(self, stream: torch.cuda.Stream, bw: _Bandwidth, dst: torch.Tensor, src: torch.Tensor,
              after: Optional[Ticket]) -> Ticket:  # fmt: skip
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)  # the data (or, for H2D, the reused device memory) is ready
            if after is not None:
                stream.wait_event(after.handle)  # Note [Device-side waits]: the host block's previous copy
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            done.record(stream)
        # No record_stream on either operand: the caller keeps them until it waited for the ticket (Note
        # [Copies without record_stream]).
        nbytes = src.numel() * src.element_size()
        self._timed.append((bw, nbytes, start, done))
        if len(self._timed) >= self._fold_at:  # Note [Timings folded as they go]
            self.measure()
            self._fold_at = max(self.FOLD_AT, 2 * len(self._timed))
        return Ticket(done, nbytes)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, after: Optional[Ticket] = None) -> Ticket:
        """Copies ``src`` (device) into ``dst`` (host) on the D2H stream, after ``after``'s copy."""
        return self._copy(self.d2h_stream, self.d2h_bw, dst, src, after)

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Optional[Ticket] = None) -> Ticket:
        """Copies ``src`` (host) into ``dst`` (device) on the H2D stream, after ``after``'s copy."""
        return self._copy(self.h2d_stream, self.h2d_bw, dst, src, after)

    def done(self, ticket: Ticket) -> bool:
        return ticket.handle.query()

    def wait_host(self, ticket: Ticket) -> float:
        """The host blocks until the copy is done (``cudaEventSynchronize``); returns the seconds waited."""
        if ticket.handle.query():
            return 0.0
        self.host_waits += 1
        t0 = time.perf_counter()
        ticket.handle.synchronize()
        return time.perf_counter() - t0

    def wait_compute(self, ticket: Ticket) -> float:
        """The compute stream waits for the copy (no host wait); returns 0 (the stall is on the device)."""
        torch.cuda.current_stream(self.device).wait_event(ticket.handle)
        return 0.0

    def measure(self) -> None:
        """Folds finished copies' event timings into the bandwidth estimates."""
        keep = []
        for bw, nbytes, start, done in self._timed:
            if done.query():
                bw.add(nbytes, start.elapsed_time(done) / 1e3)
            else:
                keep.append((bw, nbytes, start, done))
        self._timed = keep

    def drain(self) -> None:
        self.d2h_stream.synchronize()
        self.h2d_stream.synchronize()
        self.measure()

    def close(self) -> None:
        self.drain()
