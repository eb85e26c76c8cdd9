"""Every SwapManager argument is checked at construction, with a message that names the accepted forms, and
the accepted forms all work (a single module, tensor or predicate for ``exclude`` included)."""

import re

import pytest
import torch
from torch import nn

import swap


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"budget": 1.5}, TypeError, r"budget must be a number of bytes or a size string such as '12GiB'"),
        ({"budget": "lots"}, ValueError, r"budget must be .*'12GiB'.*not 'lots'"),
        ({"budget": 0}, ValueError, r"budget must be at least 1 byte"),
        ({"budget": True}, TypeError, r"budget must be"),
        ({"window": "abc"}, ValueError, r"window must be 'auto' or a number of bytes or a size string"),
        ({"window": 2.5}, TypeError, r"window must be 'auto' or a number of bytes"),
        ({"window": 0}, ValueError, r"window must be at least 1 byte"),
        ({"policy": "lru"}, ValueError, r"unknown policy 'lru': choose one of 'window', 'fixed_distance'.*'auto'"),
        ({"policy": 3}, ValueError, r"unknown policy 3: choose one of"),
        ({"strategy": "checkpoint"}, ValueError, r"unknown strategy 'checkpoint': SwapManager runs strategy='auto'"),
        ({"strategy": "auto", "policy": "all"}, ValueError, r"pass strategy='auto' or policy='all', not both"),
        ({"min_bytes": "small"}, ValueError, r"min_bytes must be .*size string.*or None"),
        ({"min_bytes": -1}, ValueError, r"min_bytes must not be negative"),
        ({"device": "gpu0"}, ValueError, r"device must be 'cpu', 'cuda', 'cuda:N', an int or a torch.device"),
        ({"device": 1.0}, TypeError, r"device must be 'cpu', 'cuda', 'cuda:N', an int or a torch.device"),
        ({"device": "meta"}, ValueError, r"device must be a CUDA device or 'cpu'"),
        ({"host_pool_limit": 0}, ValueError, r"host_pool_limit must be at least 1 byte.*None means no limit"),
        ({"host_pool_limit": "x"}, ValueError, r"host_pool_limit must be .*size string"),
        ({"exclude": 5}, TypeError, r"exclude= takes a tensor, an nn.Module, a callable\(tensor\) -> bool, or a list"),
        ({"exclude": "weights"}, TypeError, r"exclude= takes .*not str"),
        ({"exclude": [nn.Linear(2, 2), 3]}, TypeError, r"exclude= takes .*one item is int"),
        ({"swapout_threshold": "2"}, TypeError, r"swapout_threshold must be an int number of steps \(>= 1\), not '2'"),
        ({"swapout_threshold": 0}, ValueError, r"swapout_threshold must be at least 1 step"),
        ({"swapin_ahead": 1.5}, TypeError, r"swapin_ahead must be an int number of steps"),
        ({"arena": "x"}, TypeError, r"arena must be a vmalloc.Arena \(or None: found automatically"),
        ({"budget": "1GiB", "window": "2GiB"}, ValueError, r"larger than the budget"),
    ],
)
def test_bad_arguments_fail_at_construction_naming_the_accepted_forms(kwargs, error, message):
    with pytest.raises(error, match=message):
        swap.SwapManager(**{"device": "cpu", **kwargs})


def test_accepted_forms():
    for kwargs in ({"budget": 1 << 30, "window": 1 << 20}, {"budget": "1GiB", "window": "AUTO"},
                   {"min_bytes": None}, {"min_bytes": 0}, {"host_pool_limit": "64MiB"},
                   {"device": torch.device("cpu")}, {"swapout_threshold": 3, "swapin_ahead": 2}):  # fmt: skip
        swap.SwapManager(**{"device": "cpu", "budget": "1GiB", **kwargs})


def test_auto_is_a_strategy_and_policy_auto_still_means_it_with_a_warning():
    # Note [Policy and strategy]: "auto" is the joint keep / swap / recompute strategy, the default; policy= alone
    # swaps only; policy="auto", the old spelling, keeps working and says the new one.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert swap.SwapManager(device="cpu", budget="1GiB").policy == "auto"
        assert swap.SwapManager(device="cpu", budget="1GiB", strategy="auto").policy == "auto"
        assert swap.SwapManager(device="cpu", budget="1GiB", policy="all").policy == "all"
    with pytest.warns(DeprecationWarning, match=r"SwapManager\(strategy='auto'\)"):
        old = swap.SwapManager(device="cpu", budget="1GiB", policy="auto")
    assert old.policy == "auto"


def test_exclude_takes_one_module_even_a_container_and_its_parameters_stay():
    blocks = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    sm = swap.SwapManager(device="cpu", budget="1GiB", exclude=blocks)  # not iterated as a list of modules
    assert all(sm.exclude(p) for p in blocks.parameters())
    single = nn.Linear(4, 4)
    assert swap.SwapManager(device="cpu", budget="1GiB", exclude=single).exclude(single.weight)
    t = torch.randn(8)
    assert swap.SwapManager(device="cpu", budget="1GiB", exclude=t).exclude(t)
    pred = swap.SwapManager(device="cpu", budget="1GiB", exclude=lambda x: x.dim() == 3)
    assert pred.exclude(torch.randn(2, 2, 2)) and not pred.exclude(t)


def test_a_module_excluded_keeps_its_buffers_on_the_device():
    x = torch.randn(1024, 1024, requires_grad=True)
    keep = nn.Module()
    keep.register_buffer("scale", torch.randn(1024, 1024))
    with swap.SwapManager(budget="1GiB", device="cpu", min_bytes=0, exclude=keep) as sm:
        y = (x * keep.scale).sigmoid()  # mul saves the buffer (excluded); sigmoid saves y (moved)
        saved = [v.storage_ref() for v in sm.executor.vars]
        y.sum().backward()
    assert len(saved) == 1 and saved[0] is y.untyped_storage()
    assert sm.report()["swapped_out_bytes"] == 4 << 20


class FakeDeviceProperties:
    """What torch.cuda.get_device_properties reports, for a 16 GiB device (no GPU needed to check arguments)."""

    total_memory = 16 << 30


@pytest.fixture
def one_cuda_device(monkeypatch):
    """torch as a CUDA build that sees one 16 GiB device, for the checks made at construction."""
    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: FakeDeviceProperties())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only torch, or one that sees no GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda")])
def test_a_cuda_device_without_cuda_is_refused_saying_why(device):
    # On a CPU-only torch, SwapManager(device="cuda") raised torch's bare AssertionError ("Torch not compiled
    # with CUDA enabled") from inside torch; device=0 was refused as not a device at all.
    why = "is built without CUDA: install a CUDA build of PyTorch" if torch.version.cuda is None else "no CUDA device"
    with pytest.raises(ValueError, match=rf"device={re.escape(repr(device))} cannot be used: .*{why}.*, or pass "
                                         "device='cpu'"):  # fmt: skip
        swap.SwapManager(device=device)


def test_a_cuda_device_index_past_the_visible_ones_is_refused(one_cuda_device):
    with pytest.raises(ValueError, match=r"device='cuda:1' cannot be used: this process sees 1 CUDA device "
                                         r"\(cuda:0 to cuda:0\), or pass device='cpu'"):  # fmt: skip
        swap.SwapManager(device="cuda:1")
    assert swap.SwapManager(device=0, budget="1GiB").device == torch.device("cuda", 0)


def test_a_budget_above_the_device_memory_is_refused_naming_what_fits(one_cuda_device):
    # A budget above the device's memory was once planned without a word (Note [A budget above the
    # device's memory] in swap/schedule/budget.py).
    with pytest.raises(ValueError, match=r"a budget of 500.00 GiB is more than the memory of cuda:0 \(16.00 GiB\): "
                                         r"pass budget='16GiB' or less, or budget=None"):  # fmt: skip
        swap.SwapManager(device="cuda:0", budget="500GiB")
    assert swap.SwapManager(device="cuda:0", budget="16GiB").budget == 16 << 30  # all of it is allowed


def test_a_budget_above_vmalloc_capacity_is_refused_naming_how_to_raise_it(one_cuda_device):
    import vmalloc

    arena = vmalloc.Arena("sim", capacity="1GiB")  # vmalloc as the CUDA allocator holds at most its capacity
    with pytest.raises(ValueError, match=r"more than vmalloc's capacity on cuda:0 \(1.00 GiB\): pass "
                                         r"budget='1GiB' or less, or budget=None .*arena.set_capacity"):  # fmt: skip
        swap.SwapManager(device="cuda:0", budget="1025MiB", arena=arena)
    assert swap.SwapManager(device="cuda:0", budget="1GiB", arena=arena).budget == 1 << 30
    assert swap.SwapManager(device="cuda:0", arena=arena).budget == 1 << 30  # None: the capacity


def test_a_cpu_budget_is_not_compared_with_host_memory():
    # On the CPU the budget is live tensor bytes, a limit for tests and simulation: any size is taken.
    assert swap.SwapManager(device="cpu", budget="100GiB").budget == 100 << 30
