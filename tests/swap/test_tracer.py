"""What the hooks keep, and how it comes back: one variable per storage, views as views, repeated unpacks,
in-place writes, what stays put, checkpointing, errors and clean-up."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import swap

MiB = 1 << 20


class SaveViews(torch.autograd.Function):
    """Saves two views of one storage and checks, in backward, that they come back aliasing."""

    @staticmethod
    def forward(ctx, x):
        a, b = x[:, : x.shape[1] // 2], x[:, x.shape[1] // 2 :]
        ctx.save_for_backward(a, b, a)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        a, b, a2 = ctx.saved_tensors
        SaveViews.seen = (
            a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == a2.untyped_storage().data_ptr(),
            b.storage_offset() - a.storage_offset(),
            a.stride(),
        )
        return g * 2


def manager(**kw):
    kw.setdefault("budget", "1GiB")
    kw.setdefault("device", "cpu")
    kw.setdefault("min_bytes", 0)
    kw.setdefault("policy", "all")
    return swap.SwapManager(**kw)


def test_views_of_one_storage_are_one_variable_and_come_back_as_views():
    base = torch.randn(256, 1024, requires_grad=True)
    for _ in range(3):  # profile, profile, planned
        with manager() as sm:
            y = SaveViews.apply(base * 1)
            ex = sm.executor
            assert len(ex.vars) == 1  # three saved views of one storage: one variable
            y.sum().backward()
        aliased, offset, stride = SaveViews.seen
        assert aliased and offset == 512 and stride == (1024, 1)


def test_a_tensor_saved_twice_is_copied_once():
    x = torch.randn(512, 1024, requires_grad=True)
    with manager() as sm:
        h = x * 3
        (h * h).sum().backward()  # mul saves h twice
    assert sm.report()["swapped_out_bytes"] == 2 * MiB  # h once (x is a leaf requiring grad: stays)
    torch.testing.assert_close(x.grad, 18 * x.detach())


def test_unpack_can_run_more_than_once():
    x = torch.randn(256, 1024, requires_grad=True)
    w = torch.randn(1024, 1024, requires_grad=True)
    with manager():
        y = torch.tanh(x @ w)
        y.sum().backward(retain_graph=True)
        g1 = x.grad.clone()
        x.grad = None
        y.sum().backward()
    assert torch.equal(g1, x.grad)


def test_in_place_write_before_the_copy_is_reported():
    x = torch.randn(256, 1024, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified in place"):
        with manager():
            h = x * 2
            y = h.sigmoid()  # saves its result y
            y.mul_(3)  # ... which is then written in place
            z = y * 5  # the next step releases y and checks its version
            z.sum().backward()


def test_parameters_small_expanded_and_excluded_tensors_stay():
    lin = nn.Linear(1024, 1024)
    keep = torch.randn(512, 1024)
    with manager(min_bytes=MiB // 2, exclude=[keep, lambda t: t.shape == (700, 1024)]) as sm:
        x = torch.randn(512, 1024, requires_grad=True)
        small = torch.randn(16, 1024, requires_grad=True) * 1
        wide = torch.randn(1, 1024, requires_grad=True).expand(512, 1024)
        other = torch.randn(700, 1024, requires_grad=True) * 1
        out = lin(x * 1).sum() + (small * small).sum() + (wide * x).sum() + (keep * x).sum() + (other * other).sum()
        sizes = sorted(v.nbytes for v in sm.executor.vars)
        out.backward()
    # Only x * 1 (2 MiB, saved by the Linear) qualifies: the weight is a parameter, `small` is under
    # min_bytes, `wide` is an expanded view, `keep` and `other` are excluded, x is a leaf that requires grad.
    assert sizes == [2 * MiB]


def test_swap_and_non_reentrant_checkpoint_give_the_same_gradients():
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512)) for _ in range(4))

    def forward(x):
        for b in blocks:
            x = x + checkpoint(b, x, use_reentrant=False)
        return x.square().mean()

    def grads(use_swap):
        for p in blocks.parameters():
            p.grad = None
        x = torch.randn(1024, 512, generator=torch.Generator().manual_seed(1))
        if use_swap:
            with manager(policy="window", window="4MiB") as sm:
                for _ in range(3):
                    for p in blocks.parameters():
                        p.grad = None
                    forward(x).backward()
            assert sm.report()["swapped_out_bytes"] > 0  # the checkpoint boundaries' tensors were swapped
        else:
            forward(x).backward()
        return [p.grad.clone() for p in blocks.parameters()]

    for a, b in zip(grads(False), grads(True)):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"budget": -5}, ValueError, "must not be negative"),
        ({"budget": 0}, ValueError, "at least 1 byte"),
        ({"policy": "lru"}, ValueError, "unknown policy 'lru'"),
        ({"budget": "1GiB", "window": "2GiB"}, ValueError, "larger than the budget"),
        ({"window": "big"}, ValueError, "window must be 'auto' or"),
        ({"budget": 1.5}, TypeError, "budget must be a number of bytes or a size string"),
        ({"exclude": [3]}, TypeError, "exclude= takes"),
        ({"device": "meta"}, ValueError, "CUDA device or 'cpu'"),
    ],
)
def test_bad_arguments_fail_fast(kwargs, error, message):
    kwargs = {"device": "cpu", **kwargs}
    with pytest.raises(error, match=message):
        swap.SwapManager(**kwargs)


def test_an_exception_inside_removes_hooks_and_frees_the_pool():
    x = torch.randn(512, 1024, requires_grad=True)
    sm = manager()
    with pytest.raises(KeyError):
        with sm:
            y = (x * 2).sigmoid()
            raise KeyError("user error")
    assert sm.executor.closed and sm.executor.pool.closed and sm.executor.pool.reserved == 0
    # The hooks are gone: new graphs save plain tensors, and the old graph still unpacks (synchronously).
    y.sum().backward()
    z = (x * 3).sigmoid()
    assert z.grad_fn._saved_result is not None
    assert torch.equal(x.grad, (torch.sigmoid(x * 2) * (1 - torch.sigmoid(x * 2)) * 2).detach())


def test_oom_handler_evicts_least_recently_used_and_training_stays_exact():
    import vmalloc

    arena = vmalloc.Arena("host", capacity="8MiB", chunk_size="1MiB")
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(6)])
    x = torch.randn(1024, 512)

    def step():
        for p in net.parameters():
            p.grad = None
        out = net(x).square().mean()
        return out

    step().backward()
    ref = [p.grad.clone() for p in net.parameters()]
    with swap.SwapManager(budget="1GiB", device="cpu", min_bytes=0) as probe:
        for _ in range(2):
            step().backward()
    budget = probe.sequence.no_swap_peak() - 1  # just too small: planned, with most variables kept
    # policy="window": what is resident (and so evicted) is the window's; "auto" may checkpoint the blocks.
    with swap.SwapManager(budget=budget, device="cpu", min_bytes=0, window="4MiB", arena=arena, policy="window") as sm:
        for _ in range(2):
            step().backward()
        # A planned iteration; now the allocator runs out.
        loss = step()
        held = [arena.malloc(1 << 20) for _ in range(8)]
        resident_before = [v.id for v in sm.executor.vars if v.dev is not None]
        with pytest.raises(vmalloc.OutOfMemoryError):
            arena.malloc(1 << 20)  # the handler evicts (frees no arena memory on CPU), the retry still fails
        evicted = [v for v in resident_before if sm.executor.vars[v].dev is None]
        assert evicted and evicted == sorted(evicted)[: len(evicted)]  # oldest accesses first
        loss.backward()
        for h in held:
            arena.free(h)
    r = sm.report()
    assert r["evictions"] >= 1 and r["demand_fetches"] >= 1
    assert arena.stats()["num_oom_handler_calls"] == 1
    for a, p in zip(ref, net.parameters()):
        assert torch.equal(a, p.grad)
