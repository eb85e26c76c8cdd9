"""What the pack hook keeps: one Variable per storage, and a Packed handle per saved tensor.

Note [One variable per storage]
Autograd may save the same tensor twice (``x * x``), or two views of one storage (a split, a transposed
weight). Swapping each separately would copy the bytes twice and break aliasing on the way back, so a
variable is a whole storage: its bytes move once, and every handle rebuilds its own view (dtype, size,
stride, offset) on the storage that comes back.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch

from .host_pool import HostBlock


def is_parameter_like(t: torch.Tensor) -> bool:
    """Parameters, views of them (Linear saves ``weight.t()``), and genuine leaves that require grad.

    A view is judged by its base: views made inside a custom Function's forward (grad mode off) are leaves
    that require grad, yet their base is an ordinary activation."""
    if isinstance(t, torch.nn.Parameter):
        return True
    base = t._base
    if base is not None:
        return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)
    return t.is_leaf and t.requires_grad


class Exclusions:
    """``exclude=``: tensors and modules (their parameters and buffers) by storage, and predicates."""

    def __init__(self, items: Iterable[Any]) -> None:
        self.storages: set[int] = set()
        self.predicates: list[Callable[[torch.Tensor], bool]] = []
        for item in items:
            if isinstance(item, torch.nn.Module):
                for t in list(item.parameters()) + list(item.buffers()):
                    self.storages.add(t.untyped_storage().data_ptr())
            elif isinstance(item, torch.Tensor):
                self.storages.add(item.untyped_storage().data_ptr())
            elif callable(item):
                self.predicates.append(item)
            else:
                raise TypeError(
                    f"exclude= takes tensors, modules and callables(tensor) -> bool, not {type(item).__name__}"
                )

    def __call__(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.storages or any(p(t) for p in self.predicates)


class Variable:
    """A saved storage and where its bytes are: on the device (``dev``), on the host (``host``), or both."""

    __slots__ = (
        "id", "nbytes", "device", "storage_ref", "dev", "host", "d2h", "h2d", "versions", "last_access",
        "iteration", "_finalizer", "__weakref__",
    )  # fmt: skip

    def __init__(self, vid: int, storage: torch.UntypedStorage, device: torch.device, iteration: int) -> None:
        self.id = vid
        self.nbytes = storage.nbytes()
        self.device = device
        self.storage_ref = weakref.ref(storage)  # the forward's storage: alive past release => held elsewhere
        self.dev: Optional[torch.Tensor] = None  # flat uint8 over the device storage we hold
        self.host: Optional[HostBlock] = None
        self.d2h: Any = None  # ticket of the copy to host, until checked
        self.h2d: Any = None  # ticket of the copy back, until the compute stream waited on it
        self.versions: list[tuple[weakref.ref, int]] = []
        self.last_access = -1
        self.iteration = iteration
        self._finalizer: Optional[weakref.finalize] = None

    def attach(self, storage: torch.UntypedStorage) -> None:
        self.dev = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)

    def note_version(self, t: torch.Tensor) -> None:
        self.versions.append((weakref.ref(t), t._version))

    def check_versions(self) -> None:
        """Raises if a saved tensor was written in place after it was saved (its copy may be torn)."""
        for ref, version in self.versions:
            t = ref()
            if t is not None and t._version != version:
                raise RuntimeError(
                    f"swap: a tensor saved for backward (shape {tuple(t.shape)}, {t.dtype}) was modified in place "
                    f"(version {version} -> {t._version}) before its copy to host completed. Autograd would reject "
                    "this too at backward; clone the tensor before the in-place op, or exclude it with exclude=."
                )
        self.versions.clear()

    def set_host(self, block: HostBlock, free: Callable[[HostBlock], None]) -> None:
        self.host = block
        self._finalizer = weakref.finalize(self, free, block)


class Packed:
    """What autograd stores in place of a saved tensor: its variable and its view geometry."""

    __slots__ = ("var", "dtype", "size", "stride", "offset")

    def __init__(self, var: Variable, t: torch.Tensor) -> None:
        self.var = var
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()

    def view_on(self, flat: torch.Tensor) -> torch.Tensor:
        """This saved tensor as a view of the device storage behind ``flat``."""
        return torch.empty(0, dtype=self.dtype, device=flat.device).set_(
            flat.untyped_storage(), self.offset, self.size, self.stride
        )
