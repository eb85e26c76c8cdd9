"""Capture of full training steps of any ``nn.Module`` on the meta device: memory without memory.

    trace = capture(model_fn, batch_fn, 64)        # forward, loss, backward, optimizer step; twice

The model is built under ``torch.device("meta")`` and trained on meta tensors, so a batch that needs
100 GiB on a GPU is captured on a laptop. Every new storage an operator returns is an allocation, and the
storage's Python object dying (PyTorch keeps exactly one per storage) is its free. The saved-tensor hooks
mark each activation's saves and uses, and every operator is recorded with its own FLOPs and bytes, its
module, its phase and its precision, for the cost model (Note [Trace file format]). Two steps by default:
the second has the optimizer state the first created (the steady state).

Checkpointed models capture as they train: ``torch.utils.checkpoint`` (reentrant or not, with a
``context_fn``), ``checkpoint_sequential`` and Hugging Face's ``gradient_checkpointing_enable()``; the
recompute in the backward takes the same kernels as the forward (swap.capture.target), and its operators
are recorded as "recompute".

What the meta device cannot run, and the error says so (``CaptureError``: the operator, the module path,
the phase, and what to do):

- reading a tensor's value: ``.item()``, ``if tensor:``, ``.tolist()``, ``.cpu()`` (Hugging Face models
  check ``attention_mask`` for padding this way: leave it out of the batch when nothing is padded), except
  the library checks whose answer a real batch gives anyway (Note [Value checks of libraries]);
- operators whose output shape depends on values: ``nonzero``, boolean-mask indexing ``x[mask]``,
  ``masked_select``, ``unique``, ``bincount``;
- custom kernels (C++/CUDA extensions, Triton) without a meta implementation: register one with
  ``torch.library.register_fake``, or give the planner a stand-in module built from standard operators.

Autograd's gradient sums are recorded where eager PyTorch does them: in place where its engine sums in
place, although the capturing dispatch mode makes it sum out of place (Note [In-place gradient accumulation
under a dispatch mode], swap.capture.grad_accumulation).

Not modelled: ``torch.autocast`` (autocast acts on CUDA tensors only; build the model in the training dtype,
``dtype=torch.bfloat16``), ``torch.compile`` fusion, and memory an operator allocates internally.
"""

from __future__ import annotations

import gc
import sys
import time
import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .flops import operator_flops
from .grad_accumulation import EngineAccumulation
from .meta_kernels import runs_on_cpu, wider_meta_kernels
from .target import foreach_on_meta, library_value_checks, target_kernels
from .trace import (
    ALLOC,
    FORMAT_VERSION,
    FP32,
    FREE,
    ITER_BEGIN,
    ITER_END,
    LOW_PRECISION,
    SAVE,
    TAG,
    UNREF,
    USE,
    Trace,
    TraceBuilder,
)
from .traffic import moved_bytes
from .where import Where

ModelFn = Callable[[], nn.Module]
BatchFn = Callable[[int], Any]
LossFn = Callable[[nn.Module, Any], torch.Tensor]
OptimizerFn = Callable[[Any], torch.optim.Optimizer]
TARGETS = ("cuda", "cpu")


class CaptureError(RuntimeError):
    """A training step could not be captured on the meta device. ``op`` (the operator, if one failed),
    ``module`` (its path in the model), ``phase`` (forward, loss, backward, ...)."""

    def __init__(self, message: str, op: Optional[str] = None, module: Optional[str] = None, phase: str = "") -> None:
        super().__init__(message)
        self.op, self.module, self.phase = op, module, phase


# -- losses -------------------------------------------------------------------------------------------------
def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(**batch).loss`` for a dict batch; ``cross_entropy(model(x), y)`` for an ``(x, y)`` batch
    (sequence outputs ``[..., classes]`` against targets ``[...]`` are flattened, as language models need)."""
    if isinstance(batch, dict):
        out = model(**batch)
        loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
        if loss is None:
            raise ValueError(
                "the model returned no .loss for a dict batch: put the labels in the batch (Hugging Face models "
                "take labels=...), or pass loss_fn(model, batch) -> loss"
            )
        return loss
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        x, y = batch
        out = model(x)
        if isinstance(out, torch.Tensor) and out.dim() == y.dim() + 1 and out.shape[:-1] == y.shape and y.dim() > 1:
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        return F.cross_entropy(out, y)
    raise ValueError(
        f"no default loss for a batch of type {type(batch).__name__}: batch_fn should return a dict (Hugging Face "
        "style, with labels) or an (input, target) pair, or pass loss_fn(model, batch) -> loss"
    )


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    """AdamW: two state tensors per parameter, what most models train with today."""
    return torch.optim.AdamW(params, lr=1e-4)


# -- the recorder -------------------------------------------------------------------------------------------
class _Recorder(TorchDispatchMode):
    """Every new meta storage an operator returns is an allocation; its Python object dying is the free.
    Every operator that is not a view and touches a tensor is an operator event with its own cost, right
    before the allocations of its outputs (Note [Trace file format])."""

    def __init__(self, b: TraceBuilder, where: Where) -> None:
        super().__init__()
        self.b = b
        self.where = where
        self.ids: dict[int, tuple[weakref.ref, int]] = {}  # id(storage object) -> (ref, allocation id)
        self.next_id = 0
        self.watch: dict[int, tuple[weakref.ref, int]] = {}  # allocation id -> (storage ref, aliases we hold)
        self.failed_op: Optional[str] = None
        self.failed_call: Optional[tuple[Any, tuple, dict]] = None  # the operator that raised, and its inputs
        self.accumulation = EngineAccumulation()  # Note [In-place gradient accumulation under a dispatch mode]
        self.superseded: set[int] = set()  # storages whose allocation an in-place sum's result took over

    def alloc_id(self, st: torch.UntypedStorage, tag: Optional[int] = None) -> int:
        key = id(st)
        known = self.ids.get(key)
        if known is not None and known[0]() is st:
            return known[1]
        ident, n = self.next_id, st.nbytes()
        self.next_id += 1
        self.ids[key] = (weakref.ref(st, lambda _r, k=key, i=ident, n=n: self._freed(k, i, n)), ident)
        self.b.add(ALLOC, ident, n)
        if tag is not None:
            self.b.tags[ident] = tag
        return ident

    def known(self, st: torch.UntypedStorage) -> Optional[int]:
        known = self.ids.get(id(st))
        return known[1] if known is not None and known[0]() is st else None

    def _take_over(self, old: torch.UntypedStorage, new: torch.UntypedStorage) -> None:
        """``new`` continues ``old``'s allocation: no alloc is recorded for it, and no free for ``old``."""
        ident = self.known(old)
        if ident is None:  # not a storage this capture tracks (not on the meta device)
            return
        key, n = id(new), new.nbytes()
        self.superseded.add(id(old))
        self.ids[key] = (weakref.ref(new, lambda _r: self._freed(key, ident, n)), ident)

    def _freed(self, key: int, ident: int, n: int) -> None:
        if key in self.superseded:
            self.superseded.discard(key)
            return
        self.ids.pop(key, None)
        self.watch.pop(ident, None)
        self.b.add(FREE, ident, n)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        self.failed_op, self.failed_call = None, None
        summed_into = self.accumulation.in_place_operand(func, args)
        try:
            out = func(*args, **kwargs)
        except Exception:
            self.failed_op, self.failed_call = str(func), (func, args, kwargs)
            raise
        if summed_into is not None:  # eager PyTorch writes this sum into the first operand's memory
            self._take_over(summed_into.untyped_storage(), out.untyped_storage())
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.device.type == "meta"]
        if not getattr(func, "is_view", False):  # views move no data and compute nothing
            self._operator(func, args, kwargs, out, outputs)
        for t in outputs:
            self.alloc_id(t.untyped_storage())
        self._check_unrefs()
        return out

    def _operator(self, func: Any, args: tuple, kwargs: dict, out: Any, outputs: list[torch.Tensor]) -> None:
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not inputs and not outputs:
            return  # no tensor in or out: bookkeeping such as the profiler's record_function markers
        flops = operator_flops(func, args, kwargs, out)
        moved = moved_bytes(func, args, kwargs, out, outputs)
        # the operator's precision: its first float input's (or output's)
        first_float = next((t.dtype for t in (*inputs, *outputs) if t.is_floating_point()), None)
        precision = LOW_PRECISION if first_float in (torch.bfloat16, torch.float16) else FP32
        module, phase = self.where.operator()
        self.b.add_op(str(func), flops, float(moved), module, phase, precision)

    def _check_unrefs(self) -> None:
        """Activations that only our aliases (i.e. autograd) still hold: the forward dropped them here."""
        for ident, (ref, aliases) in list(self.watch.items()):
            st = ref()
            if st is not None and torch._C._storage_Use_Count(st._cdata) <= aliases + 1:
                self.b.add(UNREF, ident, st.nbytes())
                del self.watch[ident]


# -- errors -----------------------------------------------------------------------------------------------
def _advice(op: Optional[str], error: BaseException, call: Optional[tuple[Any, tuple, dict]] = None) -> str:
    text = f"{op or ''} {error}"
    if "_local_scalar_dense" in text or ".item()" in text:
        return (
            "the step reads a tensor's value (.item(), `if tensor:`, a Python bool or number from a tensor); the meta "
            "device has no values. Pass example inputs that avoid the check (Hugging Face models test "
            "attention_mask for padding this way: leave attention_mask out of the batch when nothing is padded), "
            "or move the check out of the training step."
        )
    if "Cannot copy out of meta tensor" in text:
        return "the step copies a tensor to the host (.cpu(), .numpy(), .tolist()); move that out of the training step."
    if any(k in text for k in ("nonzero", "masked_select", "unique", "bincount", "repeat_interleave")):
        return (
            "the operator's output shape depends on tensor values (nonzero, x[mask], masked_select, unique, ...), "
            "which the meta device does not have. Use a fixed-shape form (torch.where, multiplying by the mask), "
            "or pass example inputs that avoid that branch."
        )
    if any(k in text for k in ("Meta kernel", "Meta backend", "with Meta tensors", "fake impl")):
        return (
            "the operator has no meta implementation (a custom C++/CUDA/Triton kernel?). Register one with "
            "torch.library.register_fake (it only computes output shapes), or plan with a stand-in module "
            "built from standard operators that allocates the same tensors."
        )
    runs = runs_on_cpu(*call) if call is not None else False  # Note [Meta kernels narrower than the device's]
    if runs:
        return (
            f"the capture has reached its limit, not the model: {op} runs on the CPU with these shapes and dtypes, but "
            "its meta implementation refuses them. Register a meta kernel that accepts them with "
            "torch.library.register_fake (it only computes output shapes), or plan in a dtype the meta kernel "
            "accepts (dtype=...)."
        )
    if runs is None:
        return (
            f"{op} refused these inputs on the meta device. If the step runs on a real device, the capture has reached "
            "its limit (the operator's meta implementation accepts less than its device kernel: register a wider one "
            "with torch.library.register_fake); if it fails there too, fix the model or its inputs."
        )
    return "the error above is the model's own; fix it, or pass inputs/loss_fn that the model accepts."


# -- capture ------------------------------------------------------------------------------------------------
def _to_meta(batch: Any, dtype: Optional[torch.dtype]) -> Any:
    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t if t.device.type == "meta" else t.to("meta")
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    return tree_map(move, batch)


def make_batch(batch_fn: BatchFn, n: int, dtype: Optional[torch.dtype] = None) -> Any:
    """``batch_fn(n)`` on the meta device (factory functions land there); a batch_fn that cannot run under
    the meta device (a CPU generator, real data) runs normally and its tensors are moved."""
    try:
        with torch.device("meta"):
            batch = batch_fn(n)
    except (RuntimeError, NotImplementedError, TypeError):
        batch = batch_fn(n)
    return _to_meta(batch, dtype)


def build_model(model_fn: ModelFn, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """``model_fn()`` under the meta device (a model it builds elsewhere, or loads, is moved there)."""
    with torch.device("meta"):
        model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn must return an nn.Module, not {type(model).__name__}")
    if any(t.device.type != "meta" for t in list(model.parameters()) + list(model.buffers())):
        model = model.to("meta")
    if dtype is not None:
        model = model.to(dtype)
    return model.train()


def capture(
    model_fn: ModelFn,
    batch_fn: BatchFn,
    batch: int,
    loss_fn: Optional[LossFn] = None,
    *,
    optimizer: Optional[OptimizerFn] = None,
    steps: int = 2,
    target: str = "cuda",
    dtype: Optional[torch.dtype] = None,
    name: Optional[str] = None,
    progress: bool = False,
) -> Trace:
    """Records ``steps`` training steps (zero_grad, forward, loss, backward, optimizer step) at batch size
    ``batch`` on the meta device.

    Args:
        model_fn: builds the model (called under ``torch.device("meta")``).
        batch_fn: ``batch_fn(n)`` returns a batch of n samples: a dict for Hugging Face models (with labels),
            an ``(input, target)`` pair, or anything ``loss_fn`` takes.
        loss_fn: ``loss_fn(model, batch) -> loss``; default ``default_loss``.
        optimizer: ``optimizer(params) -> torch.optim.Optimizer``; default AdamW.
        target: the device whose kernel choices to mirror, "cuda" or "cpu" (Note [The target device's kernels]).
        dtype: cast the model and floating-point inputs to this dtype (bf16 training without autocast).
    Raises:
        CaptureError: a step could not run on the meta device; says which operator, where, and what to do.
    """
    if batch < 1 or steps < 1:
        raise ValueError("batch and steps must be at least 1")
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}: choose one of {', '.join(TARGETS)}")
    loss_fn = loss_fn or default_loss
    optimizer = optimizer or default_optimizer
    label = name or getattr(model_fn, "__name__", "model")
    b = TraceBuilder()
    net = _guarded(lambda: build_model(model_fn, dtype), label, None, "model construction")
    where = Where(net, b)
    rec = _Recorder(b, where)
    opt = optimizer(net.parameters())
    for p in list(net.parameters()) + list(net.buffers()):
        rec.alloc_id(p.untyped_storage(), TAG["weight"])

    class Handle:
        __slots__ = ("alias", "ident")

    def pack(t: torch.Tensor) -> Any:
        if t.device.type != "meta":
            return t
        st = t.untyped_storage()
        ident = rec.alloc_id(st)
        if b.tags.get(ident) in (TAG["weight"], TAG["input"]):
            return t
        h = Handle()
        h.alias, h.ident = t.detach(), ident
        b.tags.setdefault(ident, TAG["activation"])
        ref, aliases = rec.watch.get(ident, (weakref.ref(st), 0))
        rec.watch[ident] = (ref, aliases + 1)
        b.add(SAVE, ident, st.nbytes())
        return h

    def unpack(h: Any) -> torch.Tensor:
        if isinstance(h, torch.Tensor):
            return h
        b.add(USE, h.ident, h.alias.untyped_storage().nbytes())
        return h.alias

    def one_step(it: int) -> None:
        where.phase = "batch creation"
        data = make_batch(batch_fn, batch, dtype)
        for t in tree_flatten(data)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                b.tags[rec.alloc_id(t.untyped_storage())] = TAG["input"]
        opt.zero_grad(set_to_none=True)
        where.phase = "forward and loss"
        loss = loss_fn(net, data)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"loss_fn must return a scalar tensor, not {type(loss).__name__}")
        where.phase = "backward"
        rec.accumulation.watch(loss.grad_fn)
        try:
            loss.backward()
        finally:
            rec.accumulation.remove()
        where.phase = "optimizer step"
        for p in net.parameters():
            if p.grad is not None:
                b.tags[rec.alloc_id(p.grad.untyped_storage())] = TAG["grad"]
        opt.step()
        for state in opt.state.values():
            for t in state.values():
                if isinstance(t, torch.Tensor) and t.device.type == "meta":
                    ident = rec.known(t.untyped_storage())
                    if ident is None or b.tags.get(ident, 0) == TAG["temporary"]:
                        b.tags[rec.alloc_id(t.untyped_storage())] = TAG["optimizer_state"]
        del data, loss

    gc_was = gc.isenabled()
    gc.disable()  # frees happen when references go, not when a collection runs
    t0 = time.perf_counter()
    try:
        with where, foreach_on_meta(target == "cuda"), library_value_checks(), target_kernels(target), \
                wider_meta_kernels(), rec, torch.autograd.graph.saved_tensors_hooks(pack, unpack):  # fmt: skip
            for it in range(steps):
                b.add(ITER_BEGIN, it)
                _guarded(lambda it=it: one_step(it), label, where, None, rec)
                b.add(ITER_END, it)
                if progress:
                    print(f"  captured {label} batch {batch}: step {it + 1}/{steps} ({len(b.rows)} events, "
                          f"{time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        if gc_was:
            gc.enable()
    meta = {
        "format_version": FORMAT_VERSION, "source": "capture", "model": label, "batch": batch,
        "dtype": str(dtype or _param_dtype(net)).replace("torch.", ""), "steps": steps, "target": target,
        "parameters": sum(p.numel() for p in net.parameters()),
        "root_module": where.root,  # how ``modules`` names the model itself (its class name)
    }  # fmt: skip
    return b.build(meta)


def _param_dtype(model: nn.Module) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def _guarded(fn: Callable[[], Any], label: str, where: Optional[Where], phase: Optional[str],
             rec: Optional[_Recorder] = None) -> Any:  # fmt: skip
    """Runs ``fn``; any failure becomes a CaptureError that says what failed, where, and what to do."""
    try:
        return fn()
    except CaptureError:
        raise
    except Exception as e:
        op = rec.failed_op if rec is not None else None
        call = rec.failed_call if rec is not None else None
        phase = phase or (where.phase if where is not None else "")
        module = where.module_of(e) if where is not None else None
        at = f" in {module}" if module else ""
        what = f"{op} failed" if op else f"{type(e).__name__}"
        raise CaptureError(
            f"cannot capture a training step of {label} on the meta device: {what}{at} during {phase}: {e}\n"
            f"What to do: {_advice(op, e, call)}",
            op, module, phase,
        ) from e  # fmt: skip
