"""The model's parameters as the model-state runtime moves them: one *entry* per device storage (a parameter, or
several parameters sharing one storage), grouped into buckets in first-use order (Note [Model-state placements]
in swap.schedule.model_state.plan); the packing is the forecast's (Note [One packer]).

Note [Entries and buckets]
Copies, drops and host masters are per entry (a whole storage: its bytes move once, and every parameter and view
on it sees them, as saved activations are moved per storage: Note [One variable per storage]). A bucket is a
logical group of entries: what one use fetches and drops together, and what one host step updates. So buckets can
be re-packed once the first forward pass has shown the order parameters are read in, without moving any host
memory or optimizer state: the first iteration packs in registration order (``model.named_parameters()``), every
later one in first-use order.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...schedule.model_state import Bucket
from ...schedule.model_state import state_bytes as ledger_state_bytes


class Entry:
    """One device storage holding managed parameters: ``params`` (name, parameter) in registration order."""

    __slots__ = ("index", "storage", "key", "nbytes", "master_nbytes", "dtype", "master_dtype", "params")

    def __init__(self, index: int, storage: torch.UntypedStorage, params: list[tuple[str, torch.nn.Parameter]],
                 compute_dtype: Optional[torch.dtype] = None) -> None:  # fmt: skip
        self.index = index
        self.storage = storage
        self.key = storage._cdata  # the storage's identity across its Python wrappers
        # Bytes of the host master (the storage as the model holds it), and of the device copy: the same, or the
        # master's elements in ``compute_dtype`` (Note [Mixed precision] in swap.runtime.model_state.precision).
        self.master_dtype = params[0][1].dtype
        self.dtype = compute_dtype or self.master_dtype
        self.master_nbytes = storage.nbytes()
        self.nbytes = self.master_nbytes // self.master_dtype.itemsize * self.dtype.itemsize
        self.params = params

    def __repr__(self) -> str:
        return f"Entry({self.index}, {', '.join(n for n, _ in self.params)}, {self.nbytes} bytes)"


# Note [Frozen parameters]
# A parameter that needs no gradient (``requires_grad=False``: a frozen layer, a LoRA base weight) is model state
# like the others: its weights are streamed or kept on the host by the same plan, whether or not the optimizer
# lists it (fine-tuning recipes pass ``model.parameters()`` after freezing; LoRA recipes pass only the adapters,
# and then the frozen base is exactly what must leave the device). It gets no gradient buffer, no gradient hook
# (torch refuses one on a tensor that needs no gradient) and no optimizer state, as in plain torch, which skips
# a parameter without a gradient. Whether it needs a gradient is read when the manager starts: freeze or unfreeze
# layers before entering it.
def trains(p: torch.nn.Parameter) -> bool:
    """Whether ``p`` gets gradients (Note [Frozen parameters])."""
    return p.requires_grad


def collect_entries(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                    compute_dtype: Optional[torch.dtype] = None) -> list[Entry]:  # fmt: skip
    """The entries of the parameters ``optimizer`` steps and of the frozen ones (Note [Frozen parameters]), in
    ``model``'s registration order; ``compute_dtype``: their device copies' dtype (None: the parameters'). Raises
    ``ValueError`` for an optimizer holding parameters the model does not own, or parameters it steps that the
    runtime cannot move (frozen ones it cannot move stay where they are)."""
    names = {id(p): n for n, p in model.named_parameters()}
    stepped: dict[int, torch.nn.Parameter] = {}
    foreign = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                foreign.append(tuple(p.shape))
            stepped[id(p)] = p
    if foreign:
        raise ValueError(
            f"the optimizer steps {len(foreign)} parameter(s) the model does not own (shapes {foreign[:4]}"
            f"{', ...' if len(foreign) > 4 else ''}): pass model= the module that owns every parameter the optimizer "
            "steps (the whole model, not a submodule), or an optimizer over model.parameters()"
        )
    by_storage: dict[int, Entry] = {}
    entries: list[Entry] = []
    for name, p in model.named_parameters():
        if id(p) not in stepped:
            if trains(p) or not movable(p, device):
                continue
        else:
            _check_movable(name, p, device)
        st = p.untyped_storage()
        e = by_storage.get(st._cdata)
        if e is None:
            e = by_storage[st._cdata] = Entry(len(entries), st, [(name, p)], compute_dtype)
            entries.append(e)
            continue
        e.params.append((name, p))
    return entries


def movable(p: torch.nn.Parameter, device: torch.device) -> bool:
    """Whether the runtime can move ``p`` (``_check_movable`` says why not)."""
    return p.device == device and p.layout == torch.strided and type(p) is torch.nn.Parameter and p.is_floating_point()


def _check_movable(name: str, p: torch.nn.Parameter, device: torch.device) -> None:
    if p.device != device:
        raise ValueError(f"parameter {name} is on {p.device}, the manager's device is {device}: move the model to "
                         f"{device} before entering the manager, or pass device={str(p.device)!r}")  # fmt: skip
    if p.layout != torch.strided or type(p) is not torch.nn.Parameter:
        raise ValueError(f"parameter {name} is a {type(p).__name__} with layout {p.layout}: only dense "
                         "torch.nn.Parameter tensors can be moved; keep this model's state on the device with "
                         "model_state=swap.ModelStatePolicy(placement='resident')")  # fmt: skip
    if not p.is_floating_point():
        raise ValueError(f"parameter {name} has dtype {p.dtype}: only floating-point parameters are optimized")


def span_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor of ``t``'s size and strides spans from its first element (its storage offset aside)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def optimizer_kind(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> str:
    """``optimizer`` with ``group``'s flags as the ledger's table names it (Note [Optimizer state by optimizer] in
    swap.schedule.model_state.ledger): "adamw"/"adam", "sgd" with momentum, "sgd_plain" without, else its class."""
    if isinstance(optimizer, torch.optim.AdamW):
        return "adamw"
    if isinstance(optimizer, torch.optim.Adam):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd" if group.get("momentum", 0) else "sgd_plain"
    return type(optimizer).__name__.lower()


def state_bytes(optimizer: torch.optim.Optimizer, p: torch.nn.Parameter, group: dict[str, Any],
                dtype: Optional[torch.dtype] = None) -> int:  # fmt: skip
    """Bytes of optimizer state ``p`` will have once stepped by ``optimizer`` (its class and ``group``'s flags),
    by the ledger's table (``swap.schedule.model_state.state_bytes``); ``dtype``: its master's (None: ``p``'s)."""
    step = torch.tensor(0.0, dtype=_scalar_dtype()).element_size()
    n = span_bytes(p) // p.element_size() * (dtype or p.dtype).itemsize
    return ledger_state_bytes(optimizer_kind(optimizer, group), n, amsgrad=bool(group.get("amsgrad")),
                              step_bytes=step)  # fmt: skip


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def group_of(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """id(parameter) -> index of its group in ``optimizer``."""
    return {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}


def stepped_state_bytes(optimizer: torch.optim.Optimizer, p: torch.nn.Parameter, groups: dict[int, int],
                        dtype: Optional[torch.dtype] = None) -> int:  # fmt: skip
    """``state_bytes`` of ``p`` if ``optimizer`` steps it (``groups``: ``group_of(optimizer)``), else 0: a frozen
    parameter, or one the optimizer does not list, has no state (Note [Frozen parameters])."""
    g = groups.get(id(p))
    if g is None or not trains(p):
        return 0
    return state_bytes(optimizer, p, optimizer.param_groups[g], dtype)


def specs(entries: list[Entry], buckets: list[list[int]], optimizer: Optional[torch.optim.Optimizer]) -> list[Bucket]:
    """The plan's view of ``buckets`` (swap.schedule.model_state.Bucket), in bucket order."""
    groups = group_of(optimizer) if optimizer is not None else {}
    out = []
    for b, members in enumerate(buckets):
        # Gradients in the device copy's dtype, state in the master's (Note [Mixed precision]).
        params = [(n, p, entries[i]) for i in members for n, p in entries[i].params]
        weight = sum(entries[i].nbytes for i in members)
        master = sum(entries[i].master_nbytes for i in members)
        grad = sum(span_bytes(p) // p.element_size() * e.dtype.itemsize for _, p, e in params if trains(p))
        state = sum(stepped_state_bytes(optimizer, p, groups, e.master_dtype) for _, p, e in params
                    if optimizer is not None)  # fmt: skip
        mixed = any(entries[i].dtype != entries[i].master_dtype for i in members)
        out.append(Bucket(b, tuple(n for n, _, _ in params), sum(p.numel() for _, p, _ in params), weight, master,
                          grad, state, mixed))  # fmt: skip
    return out
