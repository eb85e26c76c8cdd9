"""What an operator does besides computing its outputs: which arguments it writes, whether its outputs alias
its inputs, whether it can be rerun. Read from the operator's schema and tags, plus the few facts schemas
leave out. Used by the operator profiler (swap.runtime.auto.op_profiler) and the recompute contexts
(swap.runtime.auto.regions).

Note [Operators that cannot be rerun]
A recompute region reruns its operators in the backward, so an operator is rerun only if doing it twice
changes nothing but its outputs:
- an explicit ``torch.Generator`` argument: checkpoint restores the default generators' state
  (``preserve_rng_state``), never a generator of the user's, so the rerun would draw other numbers;
- a side effect: a host sync that reads a value (``.item()``), or a collective (another rank would wait);
- a kernel that is not deterministic on CUDA (atomic adds: ``index_add``, ``scatter_add``, ...) while
  ``torch.use_deterministic_algorithms`` is off: the rerun may round differently.
Which scatter has duplicate indices would take a device sync to know, so every scatter counts.

A convolution rerun picks its cuDNN engine again. It finds the one its forward used (the benchmark's cache, or
the same heuristic for the same shapes) unless the engine's workspace cannot be allocated then: cuDNN falls
back to an engine that needs less, which may round differently. The allocator's workspace limit
(vmalloc's ``Arena.set_workspace_limit``, what the torch adapter offers cuDNN) is the same at the forward and
at the rerun, so with it set the choice repeats; without it, under a capacity as tight as the forward's
workspace, a rerun is bitwise only with ``torch.backends.cudnn.deterministic`` and a fixed engine. This is
left to that limit rather than blocking every convolution, which would take checkpointing from every CNN.

Such operators are *kept*: their outputs are saved (and swappable) and handed back at the rerun. Keeping
one must not change what the others compute, so a module is not checkpointed at all when a non-rerunnable
operator writes in place (its output is its input: handing it back would skip the write) or draws from the
default generator (the draws after it would shift).

A module that holds another module sharded by FSDP2 (``fully_shard`` on a submodule) is not checkpointed
either: its rerun would run that submodule's FSDP2 hooks again, whose state machine (all-gather, reshard,
pre-backward hooks on the rerun's outputs) expects one forward per backward. A module sharded by FSDP2
itself may be checkpointed: its hooks sit outside the forward the checkpoint reruns, and FSDP2's
pre-backward hook has all-gathered its parameters before any of its saved tensors is unpacked.

Writes are a separate matter: a rerun operator that writes a tensor from outside the rerun (BatchNorm's
running statistics, a counter buffer) writes a scratch copy of it instead (Note [Scratch copies] in
swap.runtime.auto.regions), and an operator that writes one of the region's inputs makes the module impossible to
checkpoint at all (autograd would find the saved input modified).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from ...capture.flops import operator_flops

# Schemas that write arguments without saying so: (operator, argument indices written when training).
LEGACY_WRITES: dict[str, tuple[int, ...]] = {
    "aten.native_batch_norm.default": (3, 4),
    "aten.cudnn_batch_norm.default": (3, 4),
    "aten.miopen_batch_norm.default": (3, 4),
    "aten._batch_norm_impl_index.default": (3, 4),
}
SIDE_EFFECTS = {"aten._local_scalar_dense.default": "a host sync that reads a value (.item())",
                "aten.item.default": "a host sync that reads a value (.item())"}  # fmt: skip
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")
NONDETERMINISTIC_ON_CUDA = {
    "aten.index_add.default", "aten.index_add_.default", "aten.scatter_add.default", "aten.scatter_add_.default",
    "aten.scatter_reduce.two", "aten.scatter_reduce_.two", "aten.index_put.default", "aten.index_put_.default",
    "aten._index_put_impl_.default", "aten.put.default", "aten.put_.default", "aten.bincount.default",
    "aten.histc.default", "aten.embedding_bag.default", "aten._embedding_bag.default",
    # Atomic writes too: the 2-d NLL loss sums its weights with atomics, and index_copy and scatter write
    # duplicate indices in whatever order the threads land (the last write wins).
    "aten.nll_loss2d_forward.default", "aten.nll_loss2d_forward.output",
    "aten.index_copy.default", "aten.index_copy.out", "aten.index_copy_.default",
    *(f"aten.scatter.{o}" for o in ("src", "value", "reduce", "value_reduce", "src_out", "value_out", "reduce_out",
                                    "value_reduce_out")),
    *(f"aten.scatter_.{o}" for o in ("src", "value", "reduce", "value_reduce")),
}  # fmt: skip


@functools.cache
def _written(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument ``func`` writes in place (schema ``Tensor(a!)``, plus
    ``LEGACY_WRITES``); read once per operator, since the rerun asks for every operator it runs."""
    schema = func._schema
    positions = {i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write}
    positions |= set(LEGACY_WRITES.get(str(func), ()))
    return tuple((i, schema.arguments[i].name if i < len(schema.arguments) else "") for i in sorted(positions))


def written_args(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes in place (schema ``Tensor(a!)``, plus ``LEGACY_WRITES``)."""
    out: list[torch.Tensor] = []
    for i, name in _written(func):
        _tensors(args[i] if i < len(args) else kwargs.get(name), out)
    return out


def replace_written(func: Any, args: tuple, kwargs: dict, swap: Any) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with each written tensor ``t`` replaced by ``swap(t)`` (Note [Scratch copies])."""
    written = _written(func)
    if not written:
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    for i, name in written:
        if i < len(args):
            args[i] = _map(args[i], swap)
        elif name in kwargs:
            kwargs[name] = _map(kwargs[name], swap)
    return tuple(args), kwargs


def aliases_output(func: Any) -> bool:
    """Whether an output is a view of an input or an input itself (views, in-place and out= operators)."""
    return any(r.alias_info is not None for r in func._schema.returns)


def draws_default_rng(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` draws from torch's default generator (which checkpoint replays), not one passed to it."""
    return torch.Tag.nondeterministic_seeded in func.tags and not _own_generator(args, kwargs)


def _own_generator(args: tuple, kwargs: dict) -> bool:
    return kwargs.get("generator") is not None or any(isinstance(a, torch.Generator) for a in args)


@functools.cache
def _operator_blocker(func: Any) -> tuple[str, bool]:
    """What of Note [Operators that cannot be rerun] the operator alone decides: why it can never be rerun
    ("" if it can), and whether its CUDA kernel is not deterministic. Read once per operator, as ``_written``."""
    name = str(func)
    if name in SIDE_EFFECTS:
        return SIDE_EFFECTS[name], False
    if func.namespace in COLLECTIVE_NAMESPACES:
        return "a collective (a rerun would make other ranks wait for it)", False
    return "", name in NONDETERMINISTIC_ON_CUDA


def blocker(func: Any, args: tuple, kwargs: dict, device: torch.device) -> str:
    """Why ``func`` cannot be rerun (Note [Operators that cannot be rerun]); "" if it can."""
    always, nondeterministic = _operator_blocker(func)
    if always:
        return always
    if _own_generator(args, kwargs):
        return "draws from a torch.Generator of its own (checkpoint replays only the default generators)"
    if nondeterministic and device.type == "cuda" and not torch.are_deterministic_algorithms_enabled():
        return "a non-deterministic CUDA kernel (torch.use_deterministic_algorithms is off)"
    return ""


PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, torch.layout,
         torch.memory_format)  # fmt: skip


def sharded_inside(module: torch.nn.Module) -> str:
    """Why ``module`` cannot be checkpointed because FSDP2 shards a module inside it on its own (Note [Operators
    that cannot be rerun]); "" if none does."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return ""
    inner = next((name for name, m in module.named_modules() if name and isinstance(m, FSDPModule)), None)
    if inner is None:
        return ""
    return (f"it holds {inner}, sharded by FSDP2 on its own: a rerun would run that module's FSDP2 hooks (its "
            "all-gather) a second time")  # fmt: skip


def stateful_argument(leaves: list) -> str:
    """Why a call with these flattened arguments cannot be rerun ("" if it can): an argument that is neither a
    tensor nor a plain value may be changed by the forward (a Hugging Face ``DynamicCache`` appends each
    layer's keys), and a rerun would change it twice (Note [Operators that cannot be rerun])."""
    for x in leaves:
        if not isinstance(x, (torch.Tensor,) + PLAIN) and not callable(x):
            name = type(x).__name__
            hint = (": pass use_cache=False (Hugging Face's own gradient checkpointing turns the cache off too)"
                    if "Cache" in name else "")  # fmt: skip
            return f"an argument is a {name}, which its forward may change (a rerun would change it twice){hint}"
    return ""


def tensors_of(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    _tensors(value, out)
    return out


def _tensors(value: Any, out: list) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _tensors(v, out)


def _map(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map(v, fn) for v in value)
    return value


def element_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> Optional[float]:
    """FLOPs as a capture counts them (torch.utils.flop_counter's registry: matmuls, convolutions, attention; and
    the kernels it does not know, such as the grouped matmul of mixture-of-experts layers: swap.capture.flops),
    else None."""
    try:
        return operator_flops(func, args, kwargs, out) or None
    except Exception:  # noqa: BLE001 - a formula that does not fit these arguments: no FLOPs known
        return None
