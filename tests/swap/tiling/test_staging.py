"""Host-input tiles pass through two reusable staging buffers (Note [Staged host tiles]): gathered without a
fresh temporary per tile, each buffer rewritten only after the copy that last read it, and input gradients
added on the host in tile order. On the CPU the copies are synchronous; fences stand in for CUDA events."""

import torch

from swap.tiling.run.staging import Staging


class Fence:
    """A CUDA event as the staging sees it, logging when it is recorded and waited for."""

    def __init__(self, log):
        self.log, self.id = log, len([e for e in log if e[0] == "record"])

    def record(self):
        self.log.append(("record", self.id))

    def synchronize(self):
        self.log.append(("wait", self.id))


def staging(log):
    return Staging(torch.device("cpu"), event=lambda: Fence(log))


def test_tiles_reuse_two_buffers_each_rewritten_after_its_last_copy():
    log = []
    s = staging(log)
    x = torch.arange(2 * 3 * 16 * 16, dtype=torch.float32).reshape(2, 3, 16, 16)
    tiles = [(slice(None), slice(None), slice(a, a + 6), slice(b, b + 6)) for a in (0, 5, 10) for b in (0, 5, 10)]
    for k, src in enumerate(tiles):
        log.append(("gather", k))
        out = s.to_device(x[src])
        assert torch.equal(out, x[src]) and out.is_contiguous()
    assert s.buffers_made == 2  # two buffers for nine tiles (a tile used to gather into a temporary of its own)
    # Tile k gathers into the buffer tile k - 2 used: after waiting for that tile's copy (fence k - 2).
    for k in range(2, len(tiles)):
        i = log.index(("gather", k))
        assert log[i + 1] == ("wait", k - 2), log[i - 2 : i + 3]


def test_gradients_are_added_on_the_host_in_tile_order_by_the_flush():
    log = []
    s = staging(log)
    grad = torch.zeros(10, dtype=torch.float64)
    parts = [(slice(0, 4), 1.0), (slice(3, 7), 0.5), (slice(6, 10), 0.25), (slice(2, 6), 0.125)]
    for k, (where, value) in enumerate(parts):
        s.add_to_host(torch.full((where.stop - where.start,), value, dtype=torch.float64), grad[where])
        if k == 0:
            assert not grad.any(), "an add waits for its copy: done when the buffer comes round, or by the flush"
    s.flush()
    expected = torch.zeros(10, dtype=torch.float64)
    for where, value in parts:
        expected[where] += value
    assert torch.equal(grad, expected)
    assert s.buffers_made == 2 and [e for e in log if e[0] == "wait"] == [("wait", i) for i in range(4)]
