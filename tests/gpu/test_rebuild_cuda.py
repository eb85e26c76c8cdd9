"""Batch norm rebuilds on CUDA (Note [Batch norm rebuilds]): the rerun picks the forward's kernel (cuDNN, or
the native one when cuDNN is off or declines), so gradients stay bitwise equal and the module's running
statistics are updated once."""

import contextlib

import pytest
import torch

from swap.runtime.activations.recompute import RecomputeHooks


def _grads(hooked: bool, dtype: torch.dtype, channels_last: bool) -> tuple[list[torch.Tensor], int]:
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.BatchNorm2d(16), torch.nn.ReLU(inplace=True),
                              torch.nn.Conv2d(16, 8, 3)).cuda().to(dtype=dtype, memory_format=fmt)  # fmt: skip
    x = torch.randn(8, 3, 32, 32, device="cuda", dtype=dtype).to(memory_format=fmt)
    hooks = RecomputeHooks()

    def pack(t):
        h = hooks.pack(t)
        return h if h is not None else t

    def unpack(p):
        return hooks.unpack(p, lambda q: q) if hooks.intercepts(p) else p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack) if hooked else contextlib.nullcontext():
        loss = net(x).float().square().mean()
    loss.backward()
    torch.cuda.synchronize()
    return [p.grad for p in net.parameters()] + list(net[1].buffers()), hooks.rebuilt


@pytest.mark.parametrize("cudnn", [True, False])
@pytest.mark.parametrize("dtype,channels_last", [(torch.float32, False), (torch.float32, True), (torch.float16, False)])
def test_batch_norm_relu_rebuild_is_bitwise_on_cuda(cudnn, dtype, channels_last):
    with torch.backends.cudnn.flags(enabled=cudnn, deterministic=True):
        ref, _ = _grads(False, dtype, channels_last)
        got, rebuilt = _grads(True, dtype, channels_last)
    assert rebuilt == 2  # the ReLU's result and the second convolution's input, both from the conv's output
    assert all(torch.equal(a, b) for a, b in zip(ref, got)), "a gradient or a running statistic differs"
