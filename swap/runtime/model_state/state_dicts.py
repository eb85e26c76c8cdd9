"""``model.state_dict()`` and ``opt.state_dict()`` (and their loads) in plain torch format while weights and
optimizer state live on the host.

Note [State dicts of offloaded model state]
The values come from, and go to, the host masters and the host optimizer state, through torch's public hooks, so
a run saved with the manager resumes without it and the other way round:
- ``model.state_dict()``: a post-hook on each module that owns managed parameters puts the host master in place of
  the (possibly dropped) parameter, after the pending host steps and any dirty device copy have landed on it. No
  weight comes to the device for it (Note [Saving without fetching]).
- ``model.load_state_dict()``: torch copies each value into its parameter; the parameter guard fetches a dropped
  one first and marks the write dirty (Note [Parameter guard]); a load post-hook on each owning module then copies
  the written weights back to their masters and drops them, one module at a time. Where the master has another
  dtype than the parameter (Note [Mixed precision] in swap.runtime.model_state.precision) the parameter holds the
  value rounded to the compute dtype, so a load pre-hook keeps the values and the post-hook then writes them into
  the masters as torch would into an fp32 parameter (``copy_``), exactly.
- ``opt.state_dict()``: a post-hook adds the host state of each offloaded parameter under the index torch gives it
  (its position over the param groups), in index order.
- ``opt.load_state_dict()``: a pre-hook takes the offloaded parameters' entries out (so torch puts nothing on the
  device for them) and a post-hook puts them, cast as torch would cast them, into the host state.
Pending host steps are waited for first, in all four.

Note [Saving without fetching]
torch's ``_save_to_state_dict`` puts ``param.detach()`` in the dict, an operator on the parameter: the parameter
guard would demand-fetch every dropped weight for it, so a checkpoint would bring the whole model to the device
(a model larger than the device could not be saved) for a value the post-hook then replaces by its host master.
So ``model.state_dict`` runs with the guard letting operators through (the runtime's own ``busy()``): the detach
of a dropped parameter is an empty view, which the post-hook replaces; resident parameters are on the device and
saved as torch saves them. Only the model's own ``state_dict`` is wrapped: a submodule's still saves correctly,
through demand fetches that the next use drops again (Note [Reads between passes] in
swap.runtime.model_state.streaming).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .buckets import Entry


def param_indices(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """id(parameter) -> its index in ``optimizer.state_dict()`` (positions over the param groups, first wins)."""
    out: dict[int, int] = {}
    start = 0
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"], start):
            out.setdefault(id(p), i)
        start += len(group["params"])
    return out


def host_state_value(key: str, value: Any, like: torch.Tensor) -> Any:
    """A loaded state value as torch's ``load_state_dict`` casts it for parameter ``like``, on the host (a copy)."""
    if not isinstance(value, torch.Tensor):
        return value
    with _disable_current_modes():
        if key == "step":
            return value.detach().to("cpu", copy=True)
        dtype = like.dtype if like.is_floating_point() else value.dtype
        return value.detach().to("cpu", dtype=dtype, copy=True)


class StateDictHooks:
    """The hooks of Note [State dicts of offloaded model state]. ``flush()`` lands every pending host step and
    dirty device copy; ``host_param(p)`` is ``p``'s host master; ``state_of(p)`` / ``set_state(p, s)`` read and set
    its host optimizer state; ``settle(entries)`` copies written device copies of ``entries`` back and drops them;
    ``offloaded(p)`` says whether ``p`` is offloaded now (a resident parameter is plain torch's business);
    ``quiet()`` is a context in which the parameter guard fetches nothing (Note [Saving without fetching]);
    ``hand_out(p)``: the tensor a state dict gives for offloaded ``p`` (its host master, or a view of it: Note
    [Masters handed out] in swap.runtime.model_state.runtime)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, entries: list[Entry],
                 flush: Callable[[], None], host_param: Callable[[Any], torch.Tensor],
                 state_of: Callable[[Any], dict], set_state: Callable[[Any, dict], None],
                 settle: Callable[[list[int]], None], offloaded: Callable[[Any], bool],
                 quiet: Callable[[], Any] = contextlib.nullcontext,
                 hand_out: Optional[Callable[[Any], torch.Tensor]] = None) -> None:  # fmt: skip
        self.model = model
        self.optimizer = optimizer
        self.entries = entries
        self.flush = flush
        self.host_param = host_param
        self.state_of = state_of
        self.set_state = set_state
        self.settle = settle
        self.offloaded = offloaded
        self.quiet = quiet
        self.hand_out = hand_out if hand_out is not None else host_param  # Note [Masters handed out]
        self.managed = {id(p): p for e in entries for _, p in e.params}
        self.entry_of = {id(p): e.index for e in entries for _, p in e.params}
        self._stash: dict[int, dict[str, Any]] = {}
        self._loading: dict[int, torch.Tensor] = {}  # id(p) -> the value being loaded into a mixed parameter
        self._handles: list[Any] = []

    def install(self) -> None:
        for module in self.model.modules():
            own = [(name, p) for name, p in module.named_parameters(recurse=False) if id(p) in self.managed]
            if own:
                self._handles.append(module.register_state_dict_post_hook(self._module_saved(own)))
                entries = sorted({self.entry_of[id(p)] for _, p in own})
                self._handles.append(module.register_load_state_dict_pre_hook(self._module_loading(own)))
                self._handles.append(module.register_load_state_dict_post_hook(self._module_loaded(entries, own)))
        opt = self.optimizer
        self._handles.append(opt.register_state_dict_post_hook(self._optimizer_saved))
        self._handles.append(opt.register_load_state_dict_pre_hook(self._optimizer_loading))
        self._handles.append(opt.register_load_state_dict_post_hook(self._optimizer_loaded))
        self._wrap_state_dict()

    def uninstall(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._unwrap()

    def _wrap_state_dict(self) -> None:
        """Note [Saving without fetching]."""
        model, original = self.model, self.model.state_dict
        self._had_own = "state_dict" in vars(model)
        self._original = original

        def state_dict(*args: Any, **kwargs: Any) -> Any:
            self.flush()
            with self.quiet():
                return original(*args, **kwargs)

        model.state_dict = state_dict

    def _unwrap(self) -> None:
        if self._had_own:
            self.model.state_dict = self._original
        elif "state_dict" in vars(self.model):
            del self.model.state_dict

    # -- the model --------------------------------------------------------------------------------------
    def _module_saved(self, own: list[tuple[str, torch.nn.Parameter]]) -> Callable[..., None]:
        def hook(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
            self.flush()
            for name, p in own:
                if prefix + name in state_dict and self.offloaded(p):
                    state_dict[prefix + name] = self.hand_out(p)

        return hook

    def _module_loading(self, own: list[tuple[str, torch.nn.Parameter]]) -> Callable[..., None]:
        def hook(module: torch.nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
            for name, p in own:
                value = state_dict.get(prefix + name)
                if isinstance(value, torch.Tensor) and value.shape == p.shape and self.offloaded(p):
                    if self.host_param(p).dtype != p.dtype:  # a mixed parameter: its master takes the value
                        self._loading[id(p)] = value

        return hook

    def _module_loaded(self, entries: list[int], own: list[tuple[str, torch.nn.Parameter]]) -> Callable[..., None]:
        def hook(module: torch.nn.Module, incompatible_keys: Any) -> None:
            self.settle(entries)
            with _disable_current_modes(), torch.no_grad():
                for _, p in own:
                    value = self._loading.pop(id(p), None)
                    if value is not None:
                        self.host_param(p).copy_(value.detach())

        return hook

    # -- the optimizer ----------------------------------------------------------------------------------
    def _optimizer_saved(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        self.flush()
        index = param_indices(optimizer)
        state = dict(state_dict["state"])
        for k, p in self.managed.items():
            s = self.state_of(p)
            if s and k in index:
                state[index[k]] = dict(s)
        return {**state_dict, "state": {i: state[i] for i in sorted(state, key=_order)}}

    def _optimizer_loading(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        self.flush()
        # Saved indices name the current parameters by position, as torch's load maps them.
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        current = [id(p) for g in optimizer.param_groups for p in g["params"]]
        by_index = dict(zip(saved, current))
        state, self._stash = {}, {}
        for i, value in state_dict["state"].items():
            k = by_index.get(i)
            if k in self.managed and self.offloaded(self.managed[k]):
                self._stash[k] = value
            else:
                state[i] = value
        return {**state_dict, "state": state}

    def _optimizer_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        for k, value in self._stash.items():
            like = self.host_param(self.managed[k])
            self.set_state(self.managed[k], {key: host_state_value(key, v, like) for key, v in value.items()})
        self._stash = {}


def _order(key: Any) -> tuple[int, Any]:
    return (0, key) if isinstance(key, int) else (1, str(key))
