"""Bad input gets a clear error saying what to change, before anything is moved: a model without its optimizer,
an optimizer stepping parameters the model does not own, optimizers whose state cannot be stepped on the host, a
step with a closure, too little host memory, and a clip that would leave the host gradients out."""

import contextlib
import re

import numpy as np
import pytest
import torch
from ms_training import batch, gpt, host_kernel, loss_of

import swap
from swap import HostMemoryError

RESIDENT = swap.ModelStatePolicy(placement="resident")


def manager(model, opt, **kw):
    kw.setdefault("model_state", swap.ModelStatePolicy(placement="streamed", bucket_bytes="64KiB"))
    return swap.SwapManager(budget="1GiB", device="cpu", policy="window", model=model, optimizer=opt, **kw)


def test_model_and_optimizer_go_together():
    m = gpt()
    with pytest.raises(ValueError, match="model= was given without optimizer="):
        swap.SwapManager(budget="1GiB", device="cpu", model=m)
    with pytest.raises(ValueError, match="optimizer= was given without model="):
        swap.SwapManager(budget="1GiB", device="cpu", optimizer=torch.optim.SGD(m.parameters(), lr=0.1))


def test_optimizer_with_foreign_parameters():
    m = gpt()
    stray = torch.nn.Parameter(torch.zeros(3, 5))
    opt = torch.optim.AdamW(list(m.parameters()) + [stray])
    with pytest.raises(ValueError, match=r"does not own \(shapes \[\(3, 5\)\]\).*pass model="):
        manager(m, opt)


def test_a_submodule_is_not_the_model():
    m = gpt()
    with pytest.raises(ValueError, match="the whole model, not a submodule"):
        manager(m.blocks[0], torch.optim.AdamW(m.parameters()))


@pytest.mark.parametrize("make, what", [
    (lambda ps: torch.optim.LBFGS(ps), "LBFGS re-evaluates the model.*placement='resident'"),
    (lambda ps: torch.optim.Adagrad(ps), "Adagrad is not supported.*Adam, AdamW, SGD.*placement='resident'"),
])  # fmt: skip
def test_unsupported_optimizers_say_what_to_do(make, what):
    m = gpt()
    with pytest.raises(ValueError, match=what):
        manager(m, make(m.parameters()))
    swap.SwapManager(budget="1GiB", device="cpu", model=m, optimizer=make(m.parameters()), model_state=RESIDENT)


def test_bad_model_state_value():
    m = gpt()
    with pytest.raises(ValueError, match="unknown placement 'host': choose one of 'auto', 'resident', 'host_master', "
                                         "'streamed'"):  # fmt: skip
        manager(m, torch.optim.AdamW(m.parameters()), model_state="host")


@contextlib.contextmanager
def backward_inside(m, opt):
    """Inside a manager, after one backward pass: (the manager, the batch)."""
    x, y = batch(m, 0)
    with manager(m, opt) as sm:
        loss_of(m, x, y).backward()
        yield sm, (x, y)


def test_step_with_a_closure_is_refused():
    m = gpt()
    opt = torch.optim.AdamW(m.parameters())
    with backward_inside(m, opt) as (sm, (x, y)):
        with pytest.raises(RuntimeError, match=r"call the closure yourself \(loss = closure\(\)\), then opt.step\(\)"):
            opt.step(lambda: loss_of(m, x, y))


def test_host_memory_refused_before_allocating_names_what_fits():
    m = gpt()
    opt = torch.optim.AdamW(m.parameters())
    n = sum(p.numel() for p in m.parameters())
    with pytest.raises(HostMemoryError) as err:
        manager(m, opt, model_state=swap.ModelStatePolicy(placement="streamed", bucket_bytes="64KiB",
                                                          host_memory=1 << 20))  # fmt: skip
    text = str(err.value)
    assert "needs" in text and "host_memory=" in text and "largest model that fits is about" in text
    # AdamW: weights, gradients and two moments, 16 bytes a parameter, plus a bucket of staging
    per_param = float(re.search(r"\(([0-9.]+) bytes each", text).group(1))
    assert 16 <= per_param < 16 * 1.2, text
    assert f"this one has {n / 1e6:.1f} M" in text
    assert all(p.untyped_storage().nbytes() > 0 for p in m.parameters())  # nothing was moved


def test_clip_imported_before_the_manager_refuses_instead_of_a_wrong_norm():
    from torch.nn.utils.clip_grad import clip_grad_norm_ as early  # the real function, as imported at start-up

    m = gpt()
    with backward_inside(m, torch.optim.AdamW(m.parameters())):
        with pytest.raises(RuntimeError, match="imported before the manager started.*sm.clip_grad_norm_"):
            early(m.parameters(), 1.0)
        assert torch.nn.utils.clip_grad_norm_ is not early  # routed while the manager runs
    assert torch.nn.utils.clip_grad_norm_ is early  # and restored at its exit
    early(m.parameters(), 1.0)


def test_gradients_made_before_entering_join_the_step():
    """A backward pass before the manager starts: its gradients move to the host and are stepped (bitwise)."""
    runs = []
    for use_manager in (False, True):
        torch.manual_seed(0)
        m = gpt()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        if not use_manager:
            host_kernel(opt)  # the host step's kernel (Note [The host kernel])
        x, y = batch(m, 0)
        loss_of(m, x, y).backward()
        if use_manager:
            with manager(m, opt):
                opt.step()
        else:
            opt.step()
        runs.append([p.detach().numpy().copy() for p in m.parameters()])
    assert all(a.tobytes() == b.tobytes() for a, b in zip(*runs))
    assert not any(np.array_equal(a, b) for a, b in zip(runs[0], [p.detach().numpy() for p in gpt().parameters()]))
