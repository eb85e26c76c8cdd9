"""Train small models plainly and under a SwapManager with model state, recording what must match bitwise:
losses, clip norms, the final parameters, gradients and optimizer state (as numpy copies, which no meter counts).
Plain runs step with the kernel the host step runs (``host_kernel``), so that they are the managed runs' reference."""

from __future__ import annotations

import gc
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from bench.metering import metered
from swap.forecast import zoo


def gpt(n_layer: int = 2, d_model: int = 64, vocab: int = 256, seq_len: int = 32) -> torch.nn.Module:
    return zoo.gpt(n_layer=n_layer, n_head=4, d_model=d_model, vocab=vocab, seq_len=seq_len)


class TiedGPT(torch.nn.Module):
    """A GPT whose output projection is the token embedding, read by the parent's forward through ``F.linear``
    (no module hook of the embedding's runs there: only the parameter guard can fetch it)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = gpt()
        self.scale = torch.nn.Parameter(torch.ones(64))  # owned by the root, read in its forward

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b = self.body
        x = b.tok(idx) + b.pos(torch.arange(idx.shape[1]))
        for block in b.blocks:
            x = block(x)
        return F.linear(b.ln(x) * self.scale, b.tok.weight)


def batch(model: torch.nn.Module, it: int, n: int = 4, seq: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (n, seq + 1), generator=torch.Generator().manual_seed(it))
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Two param groups, as fine-tuning recipes make them: no weight decay on norms and biases."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


OPTIMIZERS: dict[str, Callable[[torch.nn.Module], torch.optim.Optimizer]] = {
    "adamw": lambda m: torch.optim.AdamW(groups(m), lr=3e-3, weight_decay=0.1),
    "adam_amsgrad": lambda m: torch.optim.Adam(groups(m), lr=3e-3, amsgrad=True),
    "sgd_nesterov": lambda m: torch.optim.SGD(groups(m), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "adamw_foreach": lambda m: torch.optim.AdamW(groups(m), lr=3e-3, weight_decay=0.1, foreach=True),
    "adam_fused": lambda m: torch.optim.Adam(groups(m), lr=3e-3, fused=True),
}


def host_kernel(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt``, stepping with torch's fused CPU kernel where it leaves torch's default kernel (foreach= and fused=
    unset), its param groups and so its state dicts keeping the user's flags: plain training with the kernel the
    host step runs (Note [The host kernel] in swap/runtime/model_state/host_optim.py)."""
    if any(g.get("foreach") is not None or g.get("fused") is not None for g in opt.param_groups):
        return opt

    def fused(value: Optional[bool]) -> Callable[..., None]:
        def hook(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            for g in o.param_groups:
                g["fused"] = value

        return hook

    opt.register_step_pre_hook(fused(True))
    opt.register_step_post_hook(fused(None))
    return opt


def copy(t: Optional[torch.Tensor]) -> Optional[np.ndarray]:
    return None if t is None else t.detach().cpu().numpy().copy()


def state_arrays(sd: dict[str, Any]) -> dict[Any, Any]:
    """An optimizer state dict's tensors as numpy copies (param groups kept as they are)."""
    state = {
        i: {k: copy(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()} for i, s in sd["state"].items()
    }
    return {"state": state, "param_groups": sd["param_groups"]}


def train(build: Callable[[], torch.nn.Module] = gpt, optimizer: Any = "adamw", steps: int = 3, accum: int = 2,
          clip: Optional[str] = "torch", zero: str = "none", manager: Optional[Callable[..., Any]] = None,
          meter: Any = None, first_step: int = 0, inside: Optional[Callable[..., None]] = None,
          step_hook: Optional[Callable[[int, torch.nn.Module, Any, Any], None]] = None) -> dict[str, Any]:  # fmt: skip
    """``steps`` optimizer steps of ``accum`` micro-batches each (``optimizer``: a name in OPTIMIZERS, or a
    function of the model), an LR scheduler, clipping (``clip``: "torch",
    "sm" or None) and ``zero``: "none" (``zero_grad()`` at each step's start), "zeros" (``set_to_none=False``),
    "model" (``model.zero_grad()``) or "never". ``manager(model, opt)`` makes a SwapManager; ``inside(model, opt,
    sched)`` runs inside it before the first step (a load), and steps are numbered from ``first_step`` (their
    batches too); ``step_hook(step, model, opt, sched)`` runs after each step. Returns losses, norms, per-iteration
    meter peaks, final parameters, gradients and optimizer state."""
    gc.collect()
    torch.manual_seed(0)
    model = build()
    opt = OPTIMIZERS[optimizer](model) if isinstance(optimizer, str) else optimizer(model)
    if manager is None:
        host_kernel(opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    losses, norms, peaks = [], [], []
    sm = manager(model, opt) if manager is not None else None
    with metered(meter, sm):
        if inside is not None:
            inside(model, opt, sched)
        for step in range(first_step, first_step + steps):
            if zero == "none":
                opt.zero_grad()
            elif zero == "zeros":
                opt.zero_grad(set_to_none=False)
            elif zero == "model":
                model.zero_grad()
            for micro in range(accum):
                x, y = batch(model, step * 100 + micro)
                loss = loss_of(model, x, y)
                (loss / accum).backward()
                losses.append(loss.item())
                del loss
                if meter is not None:
                    peaks.append(meter.reset_window())
            if clip == "torch":
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())
            elif clip == "sm":
                norms.append(sm.clip_grad_norm_(0.05).item())
            opt.step()
            sched.step()
            if meter is not None:
                peaks[-1] = max(peaks[-1], meter.reset_window())
            if step_hook is not None:
                step_hook(step, model, opt, sched)
    return {
        "losses": losses, "norms": norms, "peaks": peaks, "manager": sm,
        "params": [copy(p) for p in model.parameters()],
        "grads": [copy(p.grad) for p in model.parameters()],
        "state": state_arrays(opt.state_dict()),
    }  # fmt: skip


def same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    """Identical to the last bit (``array_equal`` would call -0.0 and 0.0 equal)."""
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert list(a["state"]) == list(b["state"]), "different parameters have optimizer state"
    for i, sa in a["state"].items():
        sb = b["state"][i]
        assert list(sa) == list(sb), f"parameter {i}: state keys {list(sa)} != {list(sb)}"
        for k, v in sa.items():
            if isinstance(v, np.ndarray):
                assert same_bits(v, sb[k]), f"parameter {i}: state {k!r} differs"
            else:
                assert v == sb[k], f"parameter {i}: state {k!r} differs"


def assert_bitwise(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Losses, clip norms, parameters, gradients and optimizer state identical to the last bit."""
    assert a["losses"] == b["losses"]
    assert a["norms"] == b["norms"]
    for k, (x, y) in enumerate(zip(a["params"], b["params"])):
        assert same_bits(x, y), f"parameter {k} differs"
    for k, (x, y) in enumerate(zip(a["grads"], b["grads"])):
        assert (x is None) == (y is None), f"gradient {k}: {x is None} vs {y is None}"
        assert x is None or same_bits(x, y), f"gradient {k} differs"
    assert_same_state(a["state"], b["state"])
