"""Note [One buffer per tile shape], seen by the allocator: every tensor of a tiled step mirrored into a vmalloc
arena on the host backend (real memory), its reserved bytes are flat over tiles and over iterations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tiling_models import vgg

import swap
import vmalloc


class ArenaMirror(swap.LiveBytesMeter):
    """A LiveBytesMeter that also allocates each storage it counts in ``arena`` and frees it when the storage
    dies: the arena then serves exactly the CPU step's sequence of tensor allocations and frees."""

    def __init__(self, arena: vmalloc.Arena) -> None:
        super().__init__("cpu")
        self.arena = arena
        self.addr: dict[int, int] = {}

    def _add(self, t) -> None:  # noqa: ANN001 - LiveBytesMeter's hook
        before = len(self._sizes)
        super()._add(t)
        if len(self._sizes) != before:  # a storage counted for the first time
            st = t.untyped_storage()
            self.addr[id(st)] = self.arena.malloc(max(1, st.nbytes()))

    def _died(self, ref) -> None:  # noqa: ANN001
        key = self._sizes.get(ref, (None, 0))[0]
        super()._died(ref)
        if key in self.addr:
            self.arena.free(self.addr.pop(key))


def test_reserved_bytes_are_flat_over_tiles_and_iterations() -> None:
    arena = vmalloc.Arena("host", capacity="64MiB", chunk_size="64KiB", small_max="8KiB")
    model = vgg(c=4)
    x, y = torch.randn(1, 3, 64, 64), torch.tensor([1])
    mirror = ArenaMirror(arena)
    reserved: list[list[int]] = []

    def record(msg: str) -> None:
        if msg.startswith("backward"):
            reserved[-1].append(arena.stats()["reserved_bytes.all.current"])

    tiled = swap.tiled(model, tiles=4, progress=record)
    with mirror:
        mirror.track([*model.parameters(), x])
        created = []
        for _ in range(4):
            reserved.append([])
            model.zero_grad(set_to_none=True)
            F.cross_entropy(tiled(x), y).backward()
            created.append(arena.stats()["num_created_chunks"])
    stats = arena.stats()
    assert created[1] == created[3], created  # no new physical chunk after the first two iterations
    assert stats["num_ooms"] == 0 and len(reserved[0]) == 16
    # from the second iteration on, every tile is served from what the tiles before it freed
    assert reserved[1] == reserved[2] == reserved[3], reserved
    assert len(set(reserved[2])) == 1, reserved[2]
    assert max(reserved[3]) <= stats["reserved_bytes.all.peak"] <= 4 << 20
