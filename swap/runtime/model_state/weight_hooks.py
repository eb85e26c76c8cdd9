"""The hooks through which the model uses its weights: a forward pre-hook and post-hook on every module that owns
managed parameters, and the saved-tensor hooks' view of a saved parameter (``pack`` / ``unpack``). Each becomes a
use of the streamer (Note [Weight uses] in swap.runtime.model_state.streaming), which moves the buckets; nothing
here moves a byte."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .buckets import Entry
from .streaming import Streamer


class ParamPacked:
    """A saved view of a managed parameter, as autograd stores it: fetched back at unpack."""

    __slots__ = ("tensor", "entry")

    def __init__(self, tensor: torch.Tensor, entry: int) -> None:
        self.tensor = tensor
        self.entry = entry


class WeightHooks:
    """The uses of ``entries`` as the model makes them, told to ``streamer``. ``watched`` maps a parameter's
    storage identity to its entry (the parameter guard reads it too)."""

    def __init__(self, streamer: Streamer, entries: list[Entry]) -> None:
        self.streamer = streamer
        self.watched = {e.key: e.index for e in entries}
        self._handles: list[Any] = []

    def install(self, model: torch.nn.Module) -> None:
        """Forward pre- and post-hooks on every module that owns managed parameters."""
        owned = {id(p): e.index for e in self.streamer.entries for _, p in e.params}
        for path, module in model.named_modules():
            mine = tuple(dict.fromkeys(owned[id(p)] for p in module.parameters(recurse=False) if id(p) in owned))
            if mine:
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(mine, path)))
                self._handles.append(module.register_forward_hook(self._post_hook(mine), always_call=True))

    def uninstall(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre_hook(self, mine: tuple[int, ...], path: str) -> Callable[..., None]:
        streamer = self.streamer

        def hook(module: torch.nn.Module, args: Any) -> None:
            streamer.use(mine, path, span=True)
            streamer.next_event()

        return hook

    def _post_hook(self, mine: tuple[int, ...]) -> Callable[..., None]:
        streamer = self.streamer

        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            streamer.module_returned(mine)

        return hook

    def pack(self, t: torch.Tensor) -> Optional[ParamPacked]:
        """A saved tensor aliasing a managed parameter's storage, as autograd will keep it; else None."""
        entry = self.watched.get(t.untyped_storage()._cdata)
        return None if entry is None else ParamPacked(t, entry)

    def unpack(self, packed: ParamPacked) -> torch.Tensor:
        self.streamer.in_backward()
        self.streamer.use((packed.entry,))
        return packed.tensor
