"""Training loops as users write them, run plainly and under a SwapManager with model state (the default strategy),
recording what must match bitwise: losses, whatever the loop logs, the final parameters, gradients and optimizer
state, and each iteration's peak as an independent LiveBytesMeter sees it.

Optimizers name their kernel (``foreach=False``), so the host step and plain training run the same one whatever
torch's default is (Note [Shadow optimizer] in swap/runtime/model_state/host_step.py)."""

from __future__ import annotations

import gc
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from ms_training import copy, same_bits, state_arrays

from bench.metering import metered
from swap.forecast import zoo

VOCAB = 256


def gpt(n_layer: int = 2, d_model: int = 64) -> torch.nn.Module:
    return zoo.gpt(n_layer=n_layer, n_head=4, d_model=d_model, vocab=VOCAB, seq_len=32)


def mlp() -> torch.nn.Module:
    """A plain ``nn.Sequential``: the first module owning parameters is an indexed child (``0``)."""
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 64), torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, VOCAB))  # fmt: skip


def batch(it: int, n: int = 4, seq: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (n, seq + 1), generator=torch.Generator().manual_seed(it))
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)


Step = Callable[[torch.nn.Module, torch.optim.Optimizer, int, dict[str, list]], None]


def run(build: Callable[[], torch.nn.Module], step: Step, iters: int = 6,
        make_opt: Callable[[torch.nn.Module], torch.optim.Optimizer] = adamw,
        manager: Optional[Callable[[torch.nn.Module, torch.optim.Optimizer], Any]] = None, meter: Any = None,
        prepare: Optional[Callable[[torch.nn.Module], None]] = None) -> dict[str, Any]:  # fmt: skip
    """``iters`` calls of ``step(model, opt, it, log)`` (one iteration each: ``log`` collects what the loop
    records), plainly or inside ``manager(model, opt)``; ``prepare(model)`` runs before the optimizer is made (to
    freeze layers, say). Returns the log, per-iteration meter peaks, final parameters, gradients and optimizer
    state."""
    gc.collect()
    torch.manual_seed(0)
    model = build()
    if prepare is not None:
        prepare(model)
    opt = make_opt(model)
    log: dict[str, list] = {"loss": []}
    peaks: list[int] = []
    sm = manager(model, opt) if manager is not None else None
    with metered(meter, sm):
        if meter is not None:
            meter.reset_window()  # iterations from here: the model as the user made it may exceed the budget
        for it in range(iters):
            step(model, opt, it, log)
            if meter is not None:
                peaks.append(meter.reset_window())
    return {
        "log": log, "peaks": peaks, "manager": sm,
        "params": [copy(p) for p in model.parameters()],
        "grads": [copy(p.grad) for p in model.parameters()],
        "state": state_arrays(opt.state_dict()),
    }  # fmt: skip


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """The log, parameters, gradients and optimizer state identical to the last bit."""
    for k, xs in a["log"].items():
        ys = b["log"][k]
        assert len(xs) == len(ys), f"{k}: {len(xs)} entries vs {len(ys)}"
        for i, (x, y) in enumerate(zip(xs, ys)):
            if isinstance(x, np.ndarray):
                assert same_bits(x, y), f"{k}[{i}] differs"
            else:
                assert x == y or (x != x and y != y), f"{k}[{i}]: {x} != {y}"
    for k, (x, y) in enumerate(zip(a["params"], b["params"])):
        assert same_bits(x, y), f"parameter {k} differs"
    for k, (x, y) in enumerate(zip(a["grads"], b["grads"])):
        assert (x is None) == (y is None), f"gradient {k}: {x is None} vs {y is None}"
        assert x is None or same_bits(x, y), f"gradient {k} differs"
    sa, sb = a["state"], b["state"]
    assert sa["param_groups"] == sb["param_groups"]
    assert list(sa["state"]) == list(sb["state"]), "different parameters have optimizer state"
    for i, st in sa["state"].items():
        for key, v in st.items():
            w = sb["state"][i][key]
            assert same_bits(v, w) if isinstance(v, np.ndarray) else v == w, f"parameter {i}: state {key!r} differs"


def within(got: dict[str, Any], budget: int) -> None:
    over = [(i, p - budget) for i, p in enumerate(got["peaks"]) if p > budget]
    assert not over, f"iterations over the budget of {budget} bytes (iteration, bytes over): {over}"


def plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, it: int, log: dict[str, list]) -> None:
    """The usual iteration: zero_grad, forward, backward, step."""
    opt.zero_grad()
    x, y = batch(it)
    loss = loss_of(model, x, y)
    loss.backward()
    log["loss"].append(loss.item())
    opt.step()
