"""Copies of host-input tiles to the device, and of their gradients back, through reusable pinned buffers.

Note [Staged host tiles]
A tile of a host input is a strided slice of it (``x[:, :, a:b, c:d]``). Copied to the device from there, the
CPU first gathers it into a pageable temporary, and a copy from pageable memory makes the host wait for the
stream before the driver stages it; its input gradient came back with a blocking copy too. So each tile is
gathered into one of two pinned staging buffers, used in turn, and copied with ``non_blocking``: the host
goes on to gather the next tile into the other buffer while the device copies and computes this one. Before
the CPU writes a buffer again, it waits for the copy that last read it (an event), two tiles back. A tile's
input gradient is copied into a staging buffer the same way and added into the host gradient when that
buffer comes round again, or at ``flush``, in tile order, so the sums are the ones an unstaged run makes.

Both copies run on the compute stream: copying the next tile while this one computes would hold a second
tile's input (or gradient) on the device, which the tiling plan does not count (Note [What a tiled segment
holds] in swap/tiling/plan/cost.py). On the CPU (tests) the copies are plain and synchronous, and buffers
are not pinned.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

SLOTS = 2


class Staging:
    """Pinned buffers between host tensors and ``device`` (Note [Staged host tiles]). ``event()`` makes the
    fence recorded after each copy (CUDA events on a GPU; None: the copies are synchronous)."""

    def __init__(self, device: torch.device, event: Optional[Callable[[], Any]] = None) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.event = event if event is not None else (torch.cuda.Event if self.pinned else None)
        self._buffers: list[Optional[torch.Tensor]] = [None] * SLOTS
        self._fences: list[Any] = [None] * SLOTS  # the last copy that used each buffer
        self._adds: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = [None] * SLOTS  # (staged, into)
        self._next = 0
        self.buffers_made = 0

    def _settle(self, k: int) -> None:
        """Buffer ``k``'s last copy is done (waiting for it if not), and its gradient added where it goes."""
        fence, self._fences[k] = self._fences[k], None
        if fence is not None:
            fence.synchronize()
        add, self._adds[k] = self._adds[k], None
        if add is not None:
            staged, into = add
            into += staged

    def _stage(self, like: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The next buffer, settled and large enough, viewed as ``like``'s dtype and shape (contiguous)."""
        k, self._next = self._next, (self._next + 1) % SLOTS
        self._settle(k)
        nbytes = like.numel() * like.element_size()
        buf = self._buffers[k]
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[k] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
            self.buffers_made += 1
        return k, buf[:nbytes].view(like.dtype).view(like.shape)

    def _fence(self, k: int) -> None:
        if self.event is not None:
            fence = self._fences[k] = self.event()
            fence.record()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A device copy of host tensor ``t`` (any strides), made without a host wait."""
        k, staged = self._stage(t)
        staged.copy_(t)  # the gather, on the CPU, into pinned memory
        out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        out.copy_(staged, non_blocking=self.pinned)
        self._fence(k)
        return out

    def add_to_host(self, g: torch.Tensor, into: torch.Tensor) -> None:
        """``into += g`` for device tensor ``g`` and host tensor ``into``, done later (at the latest by
        ``flush``), in the order asked."""
        k, staged = self._stage(g)
        staged.copy_(g, non_blocking=self.pinned)
        self._fence(k)
        self._adds[k] = (staged, into)

    def flush(self) -> None:
        """Every copy done and every add made, oldest first."""
        for i in range(SLOTS):
            self._settle((self._next + i) % SLOTS)
