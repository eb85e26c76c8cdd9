"""Which gradient sums eager PyTorch does in place, predicted under a dispatch mode, against its profiler."""

from collections import Counter

import pytest
import torch
from torch.profiler import profile
from torch.utils._python_dispatch import TorchDispatchMode

from bench.traces import capture
from swap.capture.grad_accumulation import EngineAccumulation
from swap.forecast import zoo as models
from swap.forecast.from_trace import sequence_from_trace


class _Predict(TorchDispatchMode):
    def __init__(self, acc: EngineAccumulation) -> None:
        super().__init__()
        self.acc, self.sums = acc, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        if func is torch.ops.aten.add.Tensor and not self.acc._in_node:
            self.sums["add_" if self.acc.in_place_operand(func, args) is not None else "add"] += 1
        return func(*args, **(kwargs or {}))


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return models.resnet((2, 1, 1, 1), 8) if name == "resnet" else models.densenet((2, 2), 8)


@pytest.mark.parametrize("name", ["resnet", "densenet"])
def test_predicted_in_place_sums_match_eager_pytorch(name):
    net = _model(name)
    x, y = models.example_batch(net, 2, 32)
    loss = models.loss_fn(net, net(x), y)
    with profile() as prof:
        loss.backward()
    eager = Counter(e.name for e in prof.events() if e.name in ("aten::add_", "aten::add"))
    assert eager["aten::add_"] > 0  # the models do have gradient sums

    net = _model(name)
    loss = models.loss_fn(net, net(x), y)
    acc = EngineAccumulation()
    acc.watch(loss.grad_fn)
    mode = _Predict(acc)
    with mode:
        loss.backward()
    acc.remove()
    assert mode.sums["add_"] == eager["aten::add_"] and mode.sums["add"] == eager["aten::add"]


def test_capture_records_the_sums_in_place(monkeypatch):
    # ResNet-50 has 16 residual junctions, each one gradient sum per backward: a capture that emulates the
    # in-place sums makes 16 fewer allocations per step, and its peaks can only be lower.
    fixed = capture("resnet50", 4, steps=2, size=64, progress=False)
    monkeypatch.setattr(EngineAccumulation, "in_place_operand", lambda self, func, args: None)
    naive = capture("resnet50", 4, steps=2, size=64, progress=False)
    assert naive.allocations() - fixed.allocations() == 16 * 2
    assert sequence_from_trace(fixed).no_swap_peak() < sequence_from_trace(naive).no_swap_peak()
