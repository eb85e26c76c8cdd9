"""The gradient lane's upcast-and-accumulate under mixed precision (Note [Upcast, then add] in
swap/runtime/model_state/gradients.py): bitwise ``host.add_(staged)``, and no mixed-dtype ``add_`` (the CPU's
unvectorised dynamic-casting loop) on a contiguous buffer, in the helper or in a streamed bf16 run's lane."""

import threading

import pytest
import torch
from ms_training import gpt, train
from torch.utils._python_dispatch import TorchDispatchMode

import swap
from swap.runtime.model_state import gradients
from swap.runtime.model_state.gradients import CHUNK, accumulate_upcast


class MixedAdds(TorchDispatchMode):
    """Counts ``add_`` calls whose two tensors have different dtypes."""

    def __init__(self):
        super().__init__()
        self.mixed = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.add_.Tensor and args[0].dtype != args[1].dtype:
            self.mixed += 1
        return func(*args, **(kwargs or {}))


def bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("n", [1, 1000, CHUNK, 3 * CHUNK + 17])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_upcast_is_bitwise_the_mixed_add(n, dtype):
    g = torch.Generator().manual_seed(n)
    host = torch.randn(n, generator=g) * 3
    staged = (torch.randn(n, generator=g) * 1e-2).to(dtype)
    staged[: min(n, 3)] = torch.tensor([float("inf"), float("nan"), -0.0])[: min(n, 3)].to(dtype)
    want = host.clone().add_(staged)
    got = host.clone()
    with MixedAdds() as mode:
        scratch = accumulate_upcast(got, staged)
    assert mode.mixed == 0  # the fast path: upcast, then an fp32 add
    assert scratch is not None and scratch.dtype == torch.float32 and scratch.numel() >= min(n, CHUNK)
    assert torch.equal(bits(got), bits(want))
    again = host.clone()
    assert accumulate_upcast(again, staged, scratch) is scratch  # the lane's scratch is reused
    assert torch.equal(bits(again), bits(want))


def test_a_strided_buffer_keeps_the_mixed_add():
    host = torch.randn(64, 32).t()
    staged = torch.randn(64, 32).bfloat16().t()
    want = host.clone().add_(staged)
    with MixedAdds() as mode:
        assert accumulate_upcast(host, staged) is None
    assert mode.mixed == 1
    assert torch.equal(bits(host), bits(want))


def test_a_streamed_bf16_run_accumulates_without_a_mixed_add(monkeypatch):
    """Two micro-batches a step: the second backward's bf16 gradients are added on the lane, each through the
    chunked upcast (seen on the lane's thread, where the adds run)."""
    seen = {"mixed": 0, "calls": 0, "threads": set()}
    real = gradients.accumulate_upcast

    def spy(host, staged, scratch=None):
        seen["calls"] += 1
        seen["threads"].add(threading.current_thread().name)
        with MixedAdds() as mode:
            out = real(host, staged, scratch)
        seen["mixed"] += mode.mixed
        return out

    monkeypatch.setattr(gradients, "accumulate_upcast", spy)
    policy = swap.ModelStatePolicy(placement="streamed", bucket_bytes="32KiB", compute_dtype=torch.bfloat16)

    def make(model, opt):
        return swap.SwapManager(budget=1 << 30, device="cpu", model=model, optimizer=opt, model_state=policy)

    got = train(gpt, "adamw", 2, 2, manager=make)
    n = sum(1 for p in gpt().parameters() if p.requires_grad)
    assert seen["calls"] == 2 * n  # one accumulating backward a step, every parameter, two steps
    assert seen["mixed"] == 0
    assert seen["threads"] and all(t.startswith("swap-grad-lane") for t in seen["threads"])
    assert got["manager"].report()["model_state"]["precision"] == "mixed bf16 compute / fp32 master"
