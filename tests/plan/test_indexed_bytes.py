"""Gathers and in-place scatters move the bytes of the positions they index, not of the whole tensor they
index (Note [Indexed operators move what they index] in swap/capture/traffic.py)."""

import torch

from swap.capture import OP, capture


class Pick(torch.nn.Module):
    """A (rows x 1000) tensor of which one column per row is gathered, and one scattered into."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1000))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        wide = idx.float().unsqueeze(1) * self.w  # rows x 1000, fp32
        col = idx.unsqueeze(1) % 1000
        picked = wide.gather(1, col)
        wide.detach().scatter_(1, col, picked.detach())
        return picked.sum()


def test_gather_and_scatter_move_what_they_index():
    t = capture(Pick, lambda n: (torch.arange(n), None), 64, lambda m, b: m(b[0]), target="cpu")
    b, e = t.iterations()[-1]
    ops = {t.op_name(k): float(t.bytes[k]) for k in range(b, e + 1) if t.op[k] == OP}
    rows = 64
    assert ops["aten.gather.default"] == rows * 8 + rows * (4 + 4)  # index, the gathered reads, the output
    assert ops["aten.scatter_.src"] == rows * 8 + rows * 4 + rows * 4  # index, src, the written elements
    assert ops["aten.mul.Tensor"] >= rows * 1000 * 4  # an ordinary operator still counts the whole tensors
