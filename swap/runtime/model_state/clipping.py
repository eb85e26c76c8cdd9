"""Gradient clipping by global norm with gradients on the host: exact, and never silently without them.

Note [Exact clipping]
``torch.nn.utils.clip_grad_norm_`` takes each gradient's norm (grouped by device and dtype, a foreach kernel where
there is one), stacks them in that order, takes the norm of the stack, and multiplies every gradient by
``min(max_norm / (total + 1e-6), 1)``. With some gradients in host buffers the same is done with the same calls:
per-tensor norms where each gradient lives, stacked in the order plain torch would stack them (grouped by dtype,
as if all were on the compute device), the same clamped coefficient, the same multiplication of each gradient.
On CPU runs every gradient is on one device, so the result is bitwise plain torch's. On a GPU the host buffers'
norms come from the CPU kernel (a different summation order than the CUDA one): the total differs from plain
torch's by float rounding only.

While a manager with offloaded model state runs, ``torch.nn.utils.clip_grad_norm_`` (and its home,
``torch.nn.utils.clip_grad``) route calls that name managed parameters here. A copy of the function imported
before the manager started cannot be routed; it would compute the norm without the host gradients, so the helper
every such call makes next (``clip_grad._clip_grads_with_norm_``, looked up at call time) refuses when it is
handed managed parameters: an error instead of a silently wrong norm.

Note [Host operators unseen]
The host buffers are host memory, never the device's (Note [Host pool on CPU runs] in swap.runtime.machine.host_pool):
the operators the runtime runs on them on the caller's thread (the host gradients' norms and their scaling here,
their unscaling in ``scaling``) run with the Python dispatch modes off, as the copies and the host step do, so no
meter of the device counts a host buffer. On a CUDA run they are CPU tensors that a CUDA meter ignores anyway; on
a CPU run both are CPU storages, and a meter that counts every storage an operator reads (tests/swap/sweep_meter.py)
counted every host gradient buffer from the first clip on as device memory: the HF Trainer's clipping put a GPT-2
run 15 KB over its budget and a T5 one 304 KB, with no more device memory in use. Only the host norms (a scalar
each) reach the device's operators, as on a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from typing import Any, Callable, Optional, Protocol

import torch
import torch.nn.utils.clip_grad as clip_grad
from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support
from torch.utils._python_dispatch import _disable_current_modes

_FOREACH_NORM = torch.ops.aten._foreach_norm.Scalar
_FOREACH_MUL = torch.ops.aten._foreach_mul_.Tensor


def _use_foreach(tensors: list[torch.Tensor], device: torch.device, foreach: Optional[bool]) -> bool:
    """torch's rule for a group of tensors on ``device`` (raises as torch does for an impossible foreach=True)."""
    if (foreach is None and _has_foreach_support(tensors, device)) or (foreach and _device_has_foreach_support(device)):
        return True
    if foreach:
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return False


def host_ops(on_host: bool) -> Any:
    """A context for operators on host buffers (``on_host``): the dispatch modes off (Note [Host operators unseen])."""
    return _disable_current_modes() if on_host else contextlib.nullcontext()


def total_norm(grads: list[torch.Tensor], norm_type: float, error_if_nonfinite: bool, foreach: Optional[bool],
               device: torch.device, host: Optional[list[bool]] = None) -> torch.Tensor:  # fmt: skip
    """The global norm of ``grads`` (in the caller's order, each on the device or the host: ``host[i]``, default
    none), as plain torch computes it with every gradient on ``device`` (Note [Exact clipping])."""
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    on_host = host or [False] * len(grads)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(grads):
        by_dtype.setdefault(g.dtype, []).append(i)
    norms: list[torch.Tensor] = []
    for members in by_dtype.values():
        by_place: dict[tuple[torch.device, bool], list[int]] = {}
        for i in members:
            by_place.setdefault((grads[i].device, on_host[i]), []).append(i)
        found: dict[int, torch.Tensor] = {}
        for (place, hosted), idx in by_place.items():
            ts = [grads[i] for i in idx]
            with host_ops(hosted):  # per-tensor norms: the same bits however the tensors are grouped
                if _use_foreach(ts, place, foreach):
                    ns = list(_FOREACH_NORM(ts, norm_type))
                else:
                    ns = [torch.linalg.vector_norm(t, norm_type) for t in ts]
            found.update(zip(idx, ns))
        norms.extend(found[i].to(device) for i in members)
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    return total


def scale_host(grads: list[torch.Tensor], max_norm: float, total: torch.Tensor, foreach: Optional[bool]) -> bool:
    """Host gradients times ``min(max_norm / (total + 1e-6), 1)``, as ``clip_grads_with_norm_`` scales device ones
    (on the host, unseen: Note [Host operators unseen]); returns whether they were written. A coefficient of
    exactly 1 writes nothing: multiplying by 1.0 changes no float, and untouched gradients keep a speculative host
    step (Note [Speculative host steps])."""
    if not grads:
        return False
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    if bool(coef == 1.0):
        return False
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():
        place = group[0].device
        c = coef.to(place)
        with host_ops(True):
            if _use_foreach(group, place, foreach):
                _FOREACH_MUL(group, c)
            else:
                for g in group:
                    g.mul_(c)
    return True


class Clipper(Protocol):
    """What routes a clip: whether it manages a parameter, and its clip."""

    def manages(self, p: torch.Tensor) -> bool: ...

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:
        """Clips ``parameters``' gradients, the managed ones included (Note [Exact clipping])."""


_lock = threading.Lock()
_clippers: list[Clipper] = []
_originals: dict[str, Callable[..., Any]] = {}


def _routed(parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
            foreach: Optional[bool] = None) -> torch.Tensor:  # fmt: skip
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    for c in list(_clippers):
        if any(c.manages(p) for p in params):
            return c.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    return _originals["clip_grad_norm_"](params, max_norm, norm_type, error_if_nonfinite, foreach)


def _refuse_unrouted(parameters: Any, max_norm: float, total_norm: torch.Tensor,
                     foreach: Optional[bool] = None) -> None:  # fmt: skip
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if any(c.manages(p) for c in list(_clippers) for p in params):
        raise RuntimeError(
            "clip_grad_norm_ was called on parameters whose gradients the SwapManager keeps on the host, through a "
            "copy of the function imported before the manager started, so the norm it computed leaves them out. "
            "Call torch.nn.utils.clip_grad_norm_(...) by its full name, or sm.clip_grad_norm_(max_norm)"
        )
    _originals["_clip_grads_with_norm_"](params, max_norm, total_norm, foreach)


def route(clipper: Clipper) -> None:
    """Routes torch's clip_grad_norm_ for ``clipper``'s parameters until ``unroute`` (Note [Exact clipping])."""
    with _lock:
        if not _clippers:
            _originals["clip_grad_norm_"] = clip_grad.clip_grad_norm_
            _originals["_clip_grads_with_norm_"] = clip_grad._clip_grads_with_norm_
            torch.nn.utils.clip_grad_norm_ = clip_grad.clip_grad_norm_ = _routed
            clip_grad._clip_grads_with_norm_ = _refuse_unrouted
        _clippers.append(clipper)


def unroute(clipper: Clipper) -> None:
    with _lock:
        if clipper in _clippers:
            _clippers.remove(clipper)
        if not _clippers and _originals:
            torch.nn.utils.clip_grad_norm_ = clip_grad.clip_grad_norm_ = _originals.pop("clip_grad_norm_")
            clip_grad._clip_grads_with_norm_ = _originals.pop("_clip_grads_with_norm_")


def managed_split(params: Iterable[torch.Tensor], manages: Callable[[torch.Tensor], bool]) -> tuple[list, list]:
    """(managed, others) of ``params``, each in order."""
    managed, others = [], []
    for p in params:
        (managed if manages(p) else others).append(p)
    return managed, others
