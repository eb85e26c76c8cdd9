"""Meta kernels as wide as the device's, and a check of whether a refused operator runs for real.

Note [Meta kernels narrower than the device's]
A capture runs every operator on the meta device, so an operator's meta kernel decides what the capture
accepts. A few meta kernels accept less than the device kernels they stand for: PyTorch's meta kernel of
``_grouped_mm`` (the grouped matmul of mixture-of-experts layers, which Hugging Face transformers calls from
``MixtralExperts`` and others) checks the CUDA fast path's conditions, bf16 inputs only, while the CPU kernel
and CUDA's fallback multiply fp32 as well. The capture replaces such a kernel, while it runs, with a shape
rule that accepts what the device kernels accept (``wider_meta_kernels``).

Where an operator still refuses its meta inputs, the error must say whether the model or the capture is at
fault: the refused call is run once more on the CPU, with zero-filled tensors of the same shapes, dtypes and
strides (``runs_on_cpu``). If it runs there, the capture has reached its limit, not the model; if it fails
there too, the error is the model's own. Calls too large to repeat on the host say neither.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map

PROBE_LIMIT = 256 << 20  # bytes of zero-filled inputs a refused call may take to be repeated on the CPU


def grouped_mm_output(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """The output of ``aten._grouped_mm`` on the meta device, for any floating dtype the device kernels take.

    Layouts (offsets split the 2-D operand into groups): 2-D x 3-D -> (rows, n), one expert per row group;
    3-D x 2-D -> (m, columns); 2-D x 2-D -> (groups, m, n), groups along the contraction; 3-D x 3-D -> a
    batched matmul."""
    _require(
        mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
        f"_grouped_mm multiplies 2-D or 3-D operands, not {mat_a.dim()}-D and {mat_b.dim()}-D",
    )
    _require(
        mat_a.dtype == mat_b.dtype and mat_a.is_floating_point(),
        f"_grouped_mm needs operands of one floating dtype, not {mat_a.dtype} and {mat_b.dtype}",
    )
    _require(bias is None, "_grouped_mm takes no bias")
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    _require((offs is not None) == (a2 or b2), "_grouped_mm needs offsets exactly when an operand is 2-D")
    if not (a2 and b2):
        _require(mat_a.shape[-1] == mat_b.shape[-2], "_grouped_mm: the contraction dimensions differ")
    if a2 and b2:
        shape = (offs.shape[0], mat_a.shape[0], mat_b.shape[1])
    elif a2:
        _require(offs.shape[0] == mat_b.shape[0], "_grouped_mm: one offset per group of mat_b")
        shape = (mat_a.shape[0], mat_b.shape[-1])
    elif b2:
        _require(offs.shape[0] == mat_a.shape[0], "_grouped_mm: one offset per group of mat_a")
        shape = (mat_a.shape[1], mat_b.shape[1])
    else:
        _require(mat_a.shape[0] == mat_b.shape[0], "_grouped_mm: the group counts differ")
        shape = (mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1])
    return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


# aten operator name -> the meta kernel the capture uses instead of PyTorch's narrower one
WIDER: dict[str, Callable[..., torch.Tensor]] = {"_grouped_mm": grouped_mm_output}


@contextlib.contextmanager
def wider_meta_kernels() -> Iterator[None]:
    """Registers the kernels of ``WIDER`` at the Meta key while capturing (Note [Meta kernels narrower than the
    device's]); PyTorch's own come back when the capture ends. Other meta-device calls in the process take
    them too while a capture runs."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        for name, kernel in WIDER.items():
            if hasattr(torch.ops.aten, name):
                lib.impl(name, kernel, "Meta")
        yield
    finally:
        lib._destroy()


def runs_on_cpu(func: Any, args: tuple, kwargs: dict, limit: int = PROBE_LIMIT) -> Optional[bool]:
    """Whether ``func(*args, **kwargs)``, refused on the meta device, runs on the CPU with zero-filled tensors of
    the same shapes, dtypes and strides: True (it runs: the capture's limit), False (it fails there too: the
    caller's error), None (its inputs exceed ``limit`` bytes, or it has no CPU kernel: cannot tell). Runs with
    Python dispatch and autograd off, so no capture records it."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if sum(_span(t) * t.element_size() for t in tensors) > limit:
        return None

    def real(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.device.type != "meta":
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu").zero_()

    with torch._C._DisableTorchDispatch(), torch.no_grad():
        try:
            call_args, call_kwargs = tree_map(real, (args, kwargs))
            func(*call_args, **call_kwargs)
        except NotImplementedError:
            return None  # no CPU kernel: only the device it was written for can say
        except Exception:
            return False
    return True


def _span(t: torch.Tensor) -> int:
    """Elements a tensor's strides reach (what ``empty_strided`` allocates for it)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
