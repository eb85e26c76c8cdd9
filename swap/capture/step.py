"""Capture of full training steps of any ``nn.Module`` on the meta device: memory without memory.

    trace = capture(model_fn, batch_fn, 64)        # forward, loss, backward, optimizer step; twice

The model is built under ``torch.device("meta")`` and trained on meta tensors, so a batch that needs
100 GiB on a GPU is captured on a laptop. Every new storage an operator returns is an allocation, and the
storage's Python object dying (PyTorch keeps exactly one per storage) is its free. The saved-tensor hooks
mark each activation's saves and uses, and the FLOPs and bytes of the operators between them feed the
cost model. Two steps by default: the second has the optimizer state the first created (the steady state).

What the meta device cannot run, and the error says so (``CaptureError``: the operator, the module path,
the phase, and what to do):

- reading a tensor's value: ``.item()``, ``if tensor:``, ``.tolist()``, ``.cpu()`` (Hugging Face models
  check ``attention_mask`` for padding this way: leave it out of the batch when nothing is padded);
- operators whose output shape depends on values: ``nonzero``, boolean-mask indexing ``x[mask]``,
  ``masked_select``, ``unique``, ``bincount``;
- custom kernels (C++/CUDA extensions, Triton) without a meta implementation: register one with
  ``torch.library.register_fake``, or give the planner a stand-in module built from standard operators.

Autograd's gradient sums are recorded where eager PyTorch does them: in place where its engine sums in
place, although the capturing dispatch mode makes it sum out of place (Note [In-place gradient accumulation
under a dispatch mode], swap.capture.grad_accumulation).

Not modelled: ``torch.autocast`` (autocast acts on CUDA tensors only; build the model in the training dtype,
``dtype=torch.bfloat16``), ``torch.compile`` fusion, and memory an operator allocates internally.

Note [The target device's kernels]
The meta device runs the reference decomposition of ``scaled_dot_product_attention`` (the math path, which
materializes batch x heads x seq x seq attention weights), and PyTorch's optimizers take their for-loop path
for it. A GPU does neither: SDPA runs flash attention (fp16/bf16, no mask) or memory-efficient attention,
which save only a log-sum-exp per row, and optimizers default to ``foreach`` kernels with whole-model
temporaries. ``target="cuda"`` therefore routes SDPA to the CUDA kernels' own meta implementations and lets
optimizers see meta tensors as foreach-capable; ``target="cpu"`` mirrors the CPU dispatcher (flash
attention for CPU when there is no dropout, else the math path; for-loop optimizers), which is what the
plan-vs-reality check on CPU compares with.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from .grad_accumulation import EngineAccumulation
from .trace import ALLOC, FORMAT_VERSION, FREE, ITER_BEGIN, ITER_END, SAVE, TAG, UNREF, USE, Trace, TraceBuilder

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
    """Every new meta storage an operator returns is an allocation; its Python object dying is the free."""

    def __init__(self, b: TraceBuilder) -> None:
        super().__init__()
        self.b = b
        self.ids: dict[int, tuple[weakref.ref, int]] = {}  # id(storage object) -> (ref, allocation id)
        self.next_id = 0
        self.flops = 0.0
        self.moved = 0.0
        self.watch: dict[int, tuple[weakref.ref, int]] = {}  # allocation id -> (storage ref, aliases we hold)
        self.failed_op: Optional[str] = None
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
        self.failed_op = None
        summed_into = self.accumulation.in_place_operand(func, args)
        try:
            out = func(*args, **kwargs)
        except Exception:
            self.failed_op = str(func)
            raise
        if summed_into is not None:  # eager PyTorch writes this sum into the first operand's memory
            self._take_over(summed_into.untyped_storage(), out.untyped_storage())
        flop_fn = flop_registry.get(func._overloadpacket)
        if flop_fn is not None:
            self.flops += flop_fn(*args, **kwargs, out_val=out)
        view = getattr(func, "is_view", False)  # views move no data
        if not view:
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor):
                    self.moved += t.numel() * t.element_size()
            for t in _written_without_return(func, args, kwargs):
                self.moved += t.numel() * t.element_size()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                if not view:
                    self.moved += t.numel() * t.element_size()
                self.alloc_id(t.untyped_storage())
        self._check_unrefs()
        return out

    def _check_unrefs(self) -> None:
        """Activations that only our aliases (i.e. autograd) still hold: the forward dropped them here."""
        for ident, (ref, aliases) in list(self.watch.items()):
            st = ref()
            if st is not None and torch._C._storage_Use_Count(st._cdata) <= aliases + 1:
                self.b.add(UNREF, ident, st.nbytes())
                del self.watch[ident]

    def step_cost(self) -> tuple[float, float]:
        f, m = self.flops, self.moved
        self.flops = self.moved = 0.0
        return f, m


def _written_without_return(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an operator writes in place without returning them (the in-place foreach kernels
    optimizers use on CUDA return nothing). Their writes are memory traffic like the returned ``self`` of an
    ordinary in-place operator, which the bytes moved count as an output; without this a foreach optimizer
    step would count only its reads."""
    schema = getattr(func, "_schema", None)
    if schema is None or schema.returns:
        return []
    out: list[torch.Tensor] = []
    for k, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[k] if k < len(args) else kwargs.get(a.name)
            out.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return out


# -- the target device's kernels (Note [The target device's kernels]) --------------------------------------
def _float_mask(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """SDPA turns a boolean mask into an additive one before any fused kernel sees it."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask.logical_not(), float("-inf"))


class _TargetKernels(TorchFunctionMode):
    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out = self._sdpa(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)

    def _sdpa(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # noqa: ANN001, ANN202
        if q.device.type != "meta" or q.dim() != 4 or k.dim() != 4 or q.shape[-1] != v.shape[-1]:
            return None
        if enable_gqa and k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if self.target == "cpu":
            if dropout_p > 0.0:
                return None  # the CPU dispatcher takes the math path with dropout
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal, attn_mask=_float_mask(attn_mask, q.dtype), scale=scale
            )[0]
        if attn_mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
        bias = _float_mask(attn_mask, q.dtype)
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        grad = q.requires_grad or k.requires_grad or v.requires_grad
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, grad, dropout_p, is_causal, scale=scale
        )[0]


@contextlib.contextmanager
def _foreach_on_meta(enabled: bool) -> Iterator[None]:
    """Optimizers pick foreach kernels for CUDA parameters; make them do so for meta ones too."""
    import torch.optim.optimizer as optimizer_module

    original = getattr(optimizer_module, "_get_foreach_kernels_supported_devices", None)
    if not enabled or original is None:
        yield
        return
    optimizer_module._get_foreach_kernels_supported_devices = lambda: [*original(), "meta"]
    try:
        yield
    finally:
        optimizer_module._get_foreach_kernels_supported_devices = original


# -- where we are, for errors -------------------------------------------------------------------------------
class _Where:
    """The phase and the module running now (global forward hooks keep a stack of module paths)."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
        self.types = {id(m): type(m).__name__ for m in model.modules()}
        self.stack: list[int] = []
        self.phase = "model construction"
        self.handles: list[Any] = []

    def __enter__(self) -> _Where:
        reg = torch.nn.modules.module
        self.handles = [
            reg.register_module_forward_pre_hook(lambda m, _a: self.stack.append(id(m))),
            reg.register_module_forward_hook(lambda m, _a, _o: self._pop(m)),
        ]
        return self

    def _pop(self, m: nn.Module) -> None:
        if self.stack and self.stack[-1] == id(m):
            self.stack.pop()

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()

    def module(self) -> Optional[str]:
        for key in reversed(self.stack):
            if key in self.names:
                return f"module `{self.names[key]}` ({self.types[key]})"
        node = torch._C._current_autograd_node() if self.phase == "backward" else None
        return f"autograd node {node.name()}" if node is not None else None


def _advice(op: Optional[str], error: BaseException) -> str:
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
    rec = _Recorder(b)
    net = _guarded(lambda: build_model(model_fn, dtype), label, None, "model construction")
    where = _Where(net)
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
        f, m = rec.step_cost()
        b.add(SAVE, ident, st.nbytes(), f, m)
        return h

    def unpack(h: Any) -> torch.Tensor:
        if isinstance(h, torch.Tensor):
            return h
        f, m = rec.step_cost()
        b.add(USE, h.ident, h.alias.untyped_storage().nbytes(), f, m)
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
        with where, _foreach_on_meta(target == "cuda"), _TargetKernels(target), rec, \
                torch.autograd.graph.saved_tensors_hooks(pack, unpack):  # fmt: skip
            for it in range(steps):
                b.add(ITER_BEGIN, it)
                _guarded(lambda it=it: one_step(it), label, where, None, rec)
                f, m = rec.step_cost()  # the rest of backward and the optimizer step
                b.add(ITER_END, it, 0, f, m)
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
    }  # fmt: skip
    return b.build(meta)


def _param_dtype(model: nn.Module) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def _guarded(fn: Callable[[], Any], label: str, where: Optional[_Where], phase: Optional[str],
             rec: Optional[_Recorder] = None) -> Any:  # fmt: skip
    """Runs ``fn``; any failure becomes a CaptureError that says what failed, where, and what to do."""
    try:
        return fn()
    except CaptureError:
        raise
    except Exception as e:
        op = rec.failed_op if rec is not None else None
        phase = phase or (where.phase if where is not None else "")
        module = where.module() if where is not None else None
        at = f" in {module}" if module else ""
        what = f"{op} failed" if op else f"{type(e).__name__}"
        raise CaptureError(
            f"cannot capture a training step of {label} on the meta device: {what}{at} during {phase}: {e}\n"
            f"What to do: {_advice(op, e)}",
            op, module, phase,
        ) from e  # fmt: skip
