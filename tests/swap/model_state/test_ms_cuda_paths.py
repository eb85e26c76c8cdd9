"""The CUDA paths of issue 36 item 11 that a CPU run can reach, with stand-ins for torch.cuda's events and streams
and for the CUDA runtime's per-thread error (no GPU here; the real ones are the GPU lease's):

- a loop without a backward pass (evaluation, generation) keeps the copy engine's timing events bounded (Note
  [Timings folded as they go] in swap/runtime/machine/engines.py);
- a refused page-lock leaves no CUDA error behind for the next launch on its thread (Note [A failed call leaves
  no error behind] in swap/runtime/machine/host_pool.py), and the pool falls back to pageable memory."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch

from swap.runtime.machine import engines
from swap.runtime.machine.host_pool import HostPool, PinningUnavailable, TorchHostRegistrar


class FakeEvent:
    """A CUDA event whose work is done once ``FakeStream.done`` says so (copies here run at once)."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.stream: Any = None

    def record(self, stream: Any = None) -> None:
        self.stream = stream

    def query(self) -> bool:
        return self.stream is None or self.stream.done

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return 1.0  # ms


class FakeStream:
    def __init__(self, device: Any = None) -> None:
        self.done = True

    def wait_event(self, event: FakeEvent) -> None:
        pass

    def synchronize(self) -> None:
        self.done = True


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())


def test_copies_without_a_backward_pass_keep_their_timings_bounded(fake_cuda: None) -> None:
    engine = engines.CudaEngine(torch.device("cpu"))
    src, dst = torch.ones(1024), torch.empty(1024)
    for _ in range(5000):  # the weight fetches of an evaluation loop: nothing calls measure()
        engine.h2d(dst, src)
    assert len(engine._timed) <= 256, f"{len(engine._timed)} copies' timing events kept"
    engine.measure()
    assert engine.h2d_bw.bytes == 5000 * 4096  # no copy's timing was lost


def test_unfinished_copies_are_kept_and_folded_once_done(fake_cuda: None) -> None:
    engine = engines.CudaEngine(torch.device("cpu"))
    engine.h2d_stream.done = False  # a busy link: no copy has finished
    src, dst = torch.ones(256), torch.empty(256)
    for _ in range(1000):
        engine.h2d(dst, src)
    assert len(engine._timed) == 1000 and engine.h2d_bw.bytes == 0  # nothing dropped before it finished
    engine.drain()
    assert engine._timed == [] and engine.h2d_bw.bytes == 1000 * 1024


class FakeRuntime:
    """The CUDA runtime's calls the registrar makes, with its per-thread last error: a failed call sets it, and
    ``cudaGetLastError`` returns and clears it (as torch's launch check after each kernel reads it)."""

    ERROR_NOT_PERMITTED = 800

    def __init__(self) -> None:
        self.last_error = 0

    def cudaHostRegister(self, addr: int, nbytes: int, flags: int) -> int:  # noqa: N802 - the runtime's name
        self.last_error = self.ERROR_NOT_PERMITTED
        return self.ERROR_NOT_PERMITTED

    def cudaHostUnregister(self, addr: int) -> int:  # noqa: N802
        return 0

    def cudaGetErrorString(self, err: int) -> str:  # noqa: N802
        return "operation not permitted"

    def cudaGetLastError(self) -> int:  # noqa: N802
        err, self.last_error = self.last_error, 0
        return err


def test_a_refused_page_lock_leaves_no_cuda_error_for_the_next_launch() -> None:
    runtime = FakeRuntime()
    registrar = TorchHostRegistrar.__new__(TorchHostRegistrar)  # without torch.cuda.init(): no GPU here
    registrar.cudart = runtime
    pool = HostPool(pinned=True, block_size=1 << 20, pinner=registrar)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        block = pool.alloc(4096)
    assert any(issubclass(w.category, PinningUnavailable) for w in caught)  # the pageable fallback
    assert not pool.pinned and pool.pinned_bytes == 0
    assert runtime.cudaGetLastError() == 0, "the refused cudaHostRegister's error is left for the next launch"
    block.view.fill_(7)  # the pageable block works
    pool.free(block)
    pool.close()
