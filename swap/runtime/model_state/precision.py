"""Mixed precision for offloaded model state: fp32 masters and optimizer state on the host, compute copies in
``compute_dtype`` on the device (``SwapManager(model=, optimizer=, compute_dtype=torch.bfloat16)``).

Note [Mixed precision]
The user keeps the model in fp32 and names ``compute_dtype`` (bf16 or fp16) once. While the manager runs:

- the host master of each parameter is its fp32 value, and the optimizer (the user's class, run by the host step
  on the masters: Note [Shadow optimizer]) keeps fp32 state and steps the fp32 masters with fp32 gradients;
- on the device each parameter is its master cast to ``compute_dtype`` (round to nearest even, torch's ``.to``):
  the parameter object stays the same (the optimizer's references, hooks and views stay valid), its ``.data`` is
  a storage of the compute dtype with the master's geometry. The cast is made on the host, into a pinned copy of
  each entry in the compute dtype (the H2D copy's source), so the link carries compute-dtype bytes;
- the model's floating-point forward inputs (positional and keyword tensors of the root module's forward) are cast
  to ``compute_dtype``, as FSDP2's ``cast_forward_inputs`` does; buffers keep their dtype;
- the backward makes gradients in ``compute_dtype`` (a parameter read twice in one backward pass is summed there,
  by autograd, as FSDP2's unsharded parameter is); each backward pass's gradient crosses the link in that dtype, is
  upcast to fp32 on the host and accumulated in fp32 into the parameter's host gradient (the first backward of a
  step copies it, later ones add: ``g32 = g32 + float(g)``), so micro-batches accumulate in fp32;
- clipping, ``GradScaler`` (fp16 only: bf16 has fp32's range) and ``p.grad`` see the fp32 host gradients;
  ``model.state_dict()`` gives the fp32 masters, ``opt.state_dict()`` the fp32 state;
- after the manager the parameters are fp32 again, holding the masters (their gradients the fp32 host ones).

This is FSDP2's ``MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)`` on one rank with
``fully_shard`` on the root module (its reduce-scatter upcasts each backward's gradient and adds it to the fp32
sharded gradient); tests/swap/model_state/test_ms_mixed_precision.py holds the runtime to a reference loop written
that way, bitwise on CPU, and the loop to FSDP2 itself (``fully_shard`` on one gloo rank), bitwise. Only
placements that step on the host can keep an fp32 master apart from the compute copy: a bucket the plan would make
``RESIDENT`` (stepped by the user's optimizer on the device, where the parameter is the compute copy) is kept a
``HOST_MASTER`` instead, and ``model_state="resident"`` is refused.
A model already in half precision trains as today (pure bf16 or fp16: the optimizer steps what the parameters
are); the report's ``precision`` says which format ran.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .buckets import Entry

COMPUTE_DTYPES = (torch.bfloat16, torch.float16)
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def check_compute_dtype(compute_dtype: Any, mode: Optional[str]) -> Optional[torch.dtype]:
    """``compute_dtype=`` as given to the manager with ``model_state=`` ``mode`` (None: no model given): the dtype,
    or None. Raises ``TypeError`` / ``ValueError`` saying what to pass instead."""
    if compute_dtype is None:
        return None
    if not isinstance(compute_dtype, torch.dtype):
        raise TypeError(f"compute_dtype must be a torch.dtype (torch.bfloat16 or torch.float16), not "
                        f"{type(compute_dtype).__name__} {compute_dtype!r}")  # fmt: skip
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype={compute_dtype} is not a half-precision float dtype: pass torch.bfloat16 or "
                         "torch.float16 (fp32 compute needs no compute_dtype: leave it None)")  # fmt: skip
    if mode is None:
        raise ValueError("compute_dtype= casts the model's weights for compute and keeps fp32 masters on the host, "
                         "which needs model= and optimizer=: pass both, or use torch.autocast alone"
                         )  # fmt: skip
    if mode == "resident":
        raise ValueError("compute_dtype= keeps fp32 masters and optimizer state on the host, and "
                         "ModelStatePolicy(placement='resident') keeps the model state on the device as it is: use "
                         "placement='auto' or 'streamed' with compute_dtype, or torch.autocast with 'resident'"
                         )  # fmt: skip
    return compute_dtype


def check_masters(entries: list[Entry], compute_dtype: torch.dtype) -> None:
    """Every managed parameter is fp32 (the masters' dtype); else ``ValueError`` saying what to do."""
    for e in entries:
        for name, p in e.params:
            if p.dtype != torch.float32:
                what = "is already in half precision" if p.dtype in COMPUTE_DTYPES else "is not fp32"
                raise ValueError(
                    f"parameter {name} has dtype {p.dtype} and {what}: compute_dtype={compute_dtype} keeps fp32 "
                    f"masters, so keep the model in fp32 (model.float()) and let compute_dtype cast it; to train "
                    f"the model as it is ({SHORT.get(p.dtype, p.dtype)} weights and optimizer state), leave "
                    "compute_dtype None")  # fmt: skip


def precision_name(entries: list[Entry], compute_dtype: Optional[torch.dtype]) -> str:
    """The format a run trains in, for the report: "mixed bf16 compute / fp32 master", or the parameters' dtype
    ("bf16": pure bf16, masters and state in bf16; "fp32"), several joined by "+" when they differ."""
    if compute_dtype is not None:
        return f"mixed {SHORT[compute_dtype]} compute / fp32 master"
    dtypes = dict.fromkeys(e.master_dtype for e in entries)
    return "+".join(SHORT.get(d, str(d)) for d in dtypes)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def cast_forward_inputs(model: torch.nn.Module, dtype: torch.dtype) -> Any:
    """A forward pre-hook on ``model`` casting its floating-point inputs (tensors in its positional and keyword
    arguments, in lists, tuples and dicts) to ``dtype``; returns the handle to remove it (Note [Mixed
    precision])."""

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _cast(args, dtype), _cast(kwargs, dtype)

    return model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
