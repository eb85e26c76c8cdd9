"""Copies made as late as a GPU may make them, on the CPU (Note [Copies at the last moment]).

Note [Copies at the last moment]
The CPU engine (``HostEngine``) runs each copy on a worker at once, and its ``wait_compute`` blocks the host, so a
read that forgot to wait for a copy still finds it landed: the CPU tests cannot see a missing wait, which on a GPU
reads memory the copy has not written yet (review row 21; bench/gpu/lag.py delays the CUDA engine's copies for
the same reason, on a GPU). ``LastMomentEngine`` is the other extreme: a copy runs only when something waits for it
(``wait_host``, ``wait_compute``: on a CPU run the compute "stream" is the host), or waits for a later copy of its
lane (a stream runs its copies in order), or drains the engine; each after its ``after`` copy. Until then its
destination keeps what it held and its source may still change, exactly the window a busy copy stream leaves on
a GPU, made as wide as it can be. A run that is still bitwise plain torch's under it waits for every copy it
reads, and writes no memory a copy still reads. ``install`` puts it under every manager started afterwards.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Optional

import pytest
import torch

import swap.runtime.manager as manager_module
from swap.runtime.machine.engines import Ticket, _Bandwidth


class _Copy:
    __slots__ = ("lane", "dst", "src", "after", "done")

    def __init__(self, lane: str, dst: torch.Tensor, src: torch.Tensor, after: Optional[Ticket]) -> None:
        self.lane, self.dst, self.src, self.after, self.done = lane, dst, src, after, False


class LastMomentEngine:
    """The copy engine's interface (swap.runtime.machine.engines), with every copy run at the last moment (Note
    [Copies at the last moment]). ``ran``: copies run; ``waited_late``: waits that had to run their copy."""

    def __init__(self) -> None:
        self.lanes: dict[str, deque[tuple[_Copy, _Bandwidth]]] = {"d2h": deque(), "h2d": deque()}
        self.lock = threading.RLock()
        self.d2h_bw, self.h2d_bw = _Bandwidth(), _Bandwidth()
        self.host_waits = 0
        self.ran = 0
        self.waited_late = 0

    def _issue(self, lane: str, bw: _Bandwidth, dst: torch.Tensor, src: torch.Tensor,
               after: Optional[Ticket]) -> Ticket:  # fmt: skip
        c = _Copy(lane, dst, src, after)
        with self.lock:
            self.lanes[lane].append((c, bw))
        return Ticket(c, src.numel() * src.element_size())

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, after: Optional[Ticket] = None) -> Ticket:
        return self._issue("d2h", self.d2h_bw, dst, src, after)

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Optional[Ticket] = None) -> Ticket:
        return self._issue("h2d", self.h2d_bw, dst, src, after)

    def _run(self, c: _Copy) -> None:
        """Runs ``c`` and every copy issued before it on its lane, in order."""
        with self.lock:
            lane = self.lanes[c.lane]
            while not c.done:
                first, bw = lane.popleft()
                if first.after is not None:
                    self._run(first.after.handle)
                nbytes = first.src.numel() * first.src.element_size()
                t0 = time.perf_counter()
                with torch._C._DisableTorchDispatch(), torch.no_grad():  # unseen by meters, as a worker's copy
                    first.dst.copy_(first.src)
                bw.add(nbytes, max(time.perf_counter() - t0, 1e-9))
                first.dst = first.src = None
                first.done = True
                self.ran += 1

    def done(self, ticket: Ticket) -> bool:
        return ticket.handle.done

    def _wait(self, ticket: Ticket) -> float:
        if not ticket.handle.done:
            self.waited_late += 1
            self._run(ticket.handle)
        return 0.0

    def wait_host(self, ticket: Ticket) -> float:
        return self._wait(ticket)

    def wait_compute(self, ticket: Ticket) -> float:
        return self._wait(ticket)

    def measure(self) -> None:
        """Bandwidths are recorded as each copy runs."""

    def drain(self) -> None:
        with self.lock:
            for lane in self.lanes.values():
                if lane:
                    self._run(lane[-1][0])

    def close(self) -> None:
        self.drain()


def install(monkeypatch: pytest.MonkeyPatch) -> list[LastMomentEngine]:
    """Every manager started from now on copies with a ``LastMomentEngine`` (the ones made, in order)."""
    made: list[LastMomentEngine] = []
    plain = manager_module.open_resources

    def open_resources(device: Any, arena: Any, host_pool_limit: Any) -> Any:
        memory, engine, pool = plain(device, arena, host_pool_limit)
        engine.close()
        made.append(LastMomentEngine())
        return memory, made[-1], pool

    monkeypatch.setattr(manager_module, "open_resources", open_resources)
    return made
