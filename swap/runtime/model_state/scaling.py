"""Loss scaling (``torch.amp.GradScaler``) with gradients in host buffers: unscaled and checked for inf like the
device's, so a step GradScaler skips is skipped for every parameter.

Note [Unscaling host gradients]
``GradScaler.unscale_`` (and ``step``, which calls it) finds the gradients through ``p.grad``, which is None for a
parameter whose gradient the runtime keeps on the host (Note [Gradients on the host]): with every bucket offloaded
it recorded no inf check at all ("No inf checks were recorded for this optimizer"), and with some resident the
host stepped *scaled* gradients, never checked for inf. While a runtime runs, ``GradScaler._unscale_grads_`` (the
one place both reach, looked up on the class at call time, so subclasses and scalers made earlier are routed too)
runs torch's own, then, for an optimizer the runtime manages, the same kernel over the host gradients
(``_amp_foreach_non_finite_check_and_unscale_``, grouped by dtype, with the same inverse scale), after every copy
has landed, and folds their inf flag into the device's: ``scaler.step`` skips the user's ``opt.step()`` (so no
host step is queued) exactly when plain training would. Unscaling multiplies each element by the same float and
the inf check is an OR, so the result does not depend on how the gradients are grouped: bitwise plain torch's.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import torch
from torch.amp.grad_scaler import GradScaler
from torch.utils._python_dispatch import _disable_current_modes

_lock = threading.Lock()
_routes: list[tuple[torch.optim.Optimizer, Any, torch.device]] = []  # (optimizer, its GradSink, the device)
_original: list[Callable[..., Any]] = []


def host_grads(optimizer: torch.optim.Optimizer, grads: Any) -> list[torch.Tensor]:
    """The host gradients this step has of ``optimizer``'s parameters, in its order, once every copy has landed."""
    grads.settle()
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if grads.manages(p) and (g := grads.grad(p)) is not None:
                out.append(g)
    return out


def unscale(gs: list[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool,
            device: torch.device, per_device: dict[torch.device, torch.Tensor]) -> None:  # fmt: skip
    """Note [Unscaling host gradients]: ``gs`` times ``inv_scale`` in place; an inf or NaN in them sets the flag
    ``per_device[device]`` (made from ``found_inf`` if torch's pass found no gradient there)."""
    if not gs:
        return
    if not allow_fp16 and any(g.dtype == torch.float16 for g in gs):
        raise ValueError("Attempting to unscale FP16 gradients.")  # torch's own check, word for word
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in gs:
        by_dtype.setdefault(g.dtype, []).append(g)
    with torch.no_grad(), _disable_current_modes():  # host buffers (Note [Host operators unseen] in clipping)
        found = torch.zeros((), dtype=torch.float32, device=gs[0].device)
        inv = inv_scale.to(gs[0].device)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
    with torch.no_grad():
        flag = per_device.get(device)
        if flag is None:
            flag = per_device[device] = found_inf if found_inf.device == device else found_inf.to(device, copy=True)
        flag.copy_(torch.maximum(flag, found.to(device)))


def _routed(scaler: GradScaler, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
            allow_fp16: bool) -> dict[torch.device, torch.Tensor]:  # fmt: skip
    sinks = [grads for opt, grads, _ in _routes if opt is optimizer]
    if any(grads.compute_dtype == torch.bfloat16 for grads in sinks):
        raise ValueError("GradScaler with compute_dtype=torch.bfloat16: bf16 has fp32's exponent range, so loss "
                         "scaling only costs time; drop the GradScaler (loss.backward(), opt.step()), or use "
                         "compute_dtype=torch.float16, whose range needs it")  # fmt: skip
    with contextlib.ExitStack() as raw:
        for grads in sinks:  # torch's pass sees torch's attributes (Note [p.grad of an offloaded parameter])
            raw.enter_context(grads.raw())
        per_device = _original[0](scaler, optimizer, inv_scale, found_inf, allow_fp16)
    for opt, grads, device in list(_routes):
        if opt is optimizer:
            gs = host_grads(optimizer, grads)
            unscale(gs, inv_scale, found_inf, allow_fp16, device, per_device)
            # Its kernel bumps no version counter: the sink is told (Note [Speculative host steps])
            grads.touch(p for group in optimizer.param_groups for p in group["params"] if grads.manages(p))
    return per_device


def route(optimizer: torch.optim.Optimizer, grads: Any, device: torch.device) -> Callable[[], None]:
    """Routes ``GradScaler`` unscaling for ``optimizer``, whose host gradients ``grads`` (a GradSink) holds, until
    the function returned is called (Note [Unscaling host gradients])."""
    entry = (optimizer, grads, device)
    with _lock:
        if not _routes:
            _original[:] = [GradScaler._unscale_grads_]
            GradScaler._unscale_grads_ = _routed  # type: ignore[method-assign]
        _routes.append(entry)

    def unroute() -> None:
        with _lock:
            if entry in _routes:
                _routes.remove(entry)
            if not _routes and _original:
                GradScaler._unscale_grads_ = _original.pop()  # type: ignore[method-assign]

    return unroute
