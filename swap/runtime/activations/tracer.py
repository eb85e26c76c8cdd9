"""What the pack hook keeps: one Variable per storage, and a Packed handle per saved tensor.

Note [One variable per storage]
Autograd may save the same tensor twice (``x * x``), or two views of one storage (a split, a transposed
weight). Swapping each separately would copy the bytes twice and break aliasing on the way back, so a
variable is a whole storage: its bytes move once, and every handle rebuilds its own view (dtype, size,
stride, offset) on the storage that comes back.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any, Callable, Optional

import torch

from ..machine.host_pool import HostBlock

_CALL_IMPL = torch.nn.Module._call_impl.__code__
# Note [Views outside the meter]: making a view allocates nothing, and its storage is already counted, so
# the hooks make views with Python dispatch off: a dispatch mode (the CPU meter) would cost ~20 us per view.
_no_dispatch = torch._C._DisableTorchDispatch
_AOT_DIR = os.path.join("torch", "_functorch", "_aot_autograd") + os.sep  # compiled regions' runtime


# The backward node running now (None outside backward).
current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def backward_running() -> bool:
    """Whether this thread is running a backward pass (autograd's engine has a graph task for it).

    Note [Unpacks outside backward]
    A saved tensor can be read outside backward: ``grad_fn._saved_self`` after a forward (torchviz's
    ``show_saved``, a debugger, a test). That is no step of the iteration, and no end of backward can be
    queued for it (autograd accepts final callbacks only while a backward runs on the thread, and raises
    otherwise). Such an unpack is served like one from an old graph (``Transfers.fetch_outside``: the
    forward's storage if it is still alive, else a copy the caller alone holds) and leaves the iteration's
    plan and its boundaries alone."""
    return _graph_task_id is None or _graph_task_id() != -1


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


def passthrough(t: torch.Tensor) -> torch.Tensor:
    """What the pack hook returns for a tensor it leaves alone.

    Not ``t`` itself when ``t`` has a grad_fn: a saved output would then hold its own grad_fn through the
    hook's result, a reference cycle through C++ that Python's collector cannot see, so a graph dropped
    without backward (an evaluation forward with grad enabled) would never be freed. ``detach()`` shares
    the storage and the version counter, and holds no grad_fn."""
    if t.grad_fn is None:
        return t
    with _no_dispatch():
        return t.detach()


class Exclusions:
    """``exclude=``: tensors and modules (their parameters and buffers) by storage, and predicates.

    Takes one item or a list/tuple/set of them. A module is always one item, even a container such as
    ``nn.Sequential`` (its parameters are excluded, it is not unpacked as a list); so is a tensor."""

    ACCEPTED = "a tensor, an nn.Module, a callable(tensor) -> bool, or a list of them"

    def __init__(self, items: Any) -> None:
        self.storages: set[int] = set()
        self.predicates: list[Callable[[torch.Tensor], bool]] = []
        if items is None:
            items = ()
        if isinstance(items, (torch.Tensor, torch.nn.Module)) or (callable(items) and not isinstance(items, type)):
            items = (items,)
        elif not isinstance(items, (list, tuple, set, frozenset)):
            raise TypeError(f"exclude= takes {self.ACCEPTED}, not {type(items).__name__}")
        for item in items:
            if isinstance(item, torch.nn.Module):
                for t in list(item.parameters()) + list(item.buffers()):
                    self.storages.add(t.untyped_storage().data_ptr())
            elif isinstance(item, torch.Tensor):
                self.storages.add(item.untyped_storage().data_ptr())
            elif callable(item) and not isinstance(item, type):
                self.predicates.append(item)
            else:
                raise TypeError(f"exclude= takes {self.ACCEPTED}; one item is {type(item).__name__}")

    def __bool__(self) -> bool:
        return bool(self.storages or self.predicates)

    def __call__(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.storages or any(p(t) for p in self.predicates)


class ModulePaths:
    """The path of the module running now (``"encoder.layer.3.attention"``), read from the Python stack.

    Note [Module paths from the stack]
    The issue asked for the module at each step, "recorded by module hooks". Global module hooks would run
    on every module call of every iteration, and torch.compile traces them (guards on the hook dicts, so
    adding or removing them recompiles). Reading the stack only when the profiler asks (at a saved tensor,
    in profiling iterations) costs nothing elsewhere: each ``nn.Module._call_impl`` frame on the stack is a
    module being run, outermost first; a child's name is looked up once in its parent's ``named_modules``.
    """

    def __init__(self) -> None:
        self._names: dict[tuple[int, int], str] = {}
        self.compiled = False  # the last ``current()`` ran inside a torch.compile'd region
        self.in_module = False  # the last ``current()`` ran inside some module's call (compiled or not)
        self._root: Optional[weakref.ref] = None  # the last ``current()``'s outermost module (weakly)

    def current(self) -> str:
        chain = []
        compiled = False
        f = sys._getframe(1)
        while f is not None:
            code = f.f_code
            if code is _CALL_IMPL:
                m = f.f_locals.get("self")
                if isinstance(m, torch.nn.Module):
                    chain.append(m)
            elif not compiled and _AOT_DIR in code.co_filename:
                compiled = True
            f = f.f_back
        self.compiled = compiled
        self.in_module = bool(chain)
        self._root = weakref.ref(chain[-1]) if chain else None
        chain.reverse()
        parts = [self._name(parent, child) for parent, child in zip(chain, chain[1:])]
        return ".".join(p for p in parts if p)

    @property
    def root(self) -> Optional[torch.nn.Module]:
        """The outermost module of the last ``current()`` (held weakly: the executor must not keep a model)."""
        return self._root() if self._root is not None else None

    def _name(self, parent: torch.nn.Module, child: torch.nn.Module) -> str:
        if getattr(parent, "_orig_mod", None) is child:
            return ""  # torch.compile's wrapper (OptimizedModule) is transparent: "layers.0", not "layers.0._orig_mod"
        key = (id(parent), id(child))
        name = self._names.get(key)
        if name is None:
            name = next((n for n, m in parent.named_modules() if m is child and n), type(child).__name__)
            self._names[key] = name
        return name


class Variable:
    """A saved storage and where its bytes are: on the device (``dev``), on the host (``host``), or both.

    Its life follows autograd's: each ``Packed`` handle counts (``handles``); when the last one dies (the
    node that used it has run, or its graph was dropped) ``owner.var_dead`` releases it. The forward's own
    storage is watched with a weak reference: it outliving our release means someone else holds the tensor
    (``owner.original_died`` learns when that ends).
    """

    __slots__ = (
        "id", "nbytes", "size", "device", "storage_ref", "dev", "host", "d2h", "h2d", "versions", "last_access",
        "iteration", "handles", "alive", "on_device", "copy_ref", "dev_is_copy", "module", "owner", "_finalizer",
        "__weakref__",
    )  # fmt: skip

    def __init__(
        self, vid: int, storage: torch.UntypedStorage, device: torch.device, iteration: int, owner: Any = None,
        size: Optional[int] = None,
    ) -> None:
        self.id = vid
        self.nbytes = storage.nbytes()  # what a copy moves
        # What the device's allocator counts for it (default: its bytes): what it is planned and counted with
        # (Note [Sizes as the allocator counts them] in swap/runtime/machine/memory.py).
        self.size = self.nbytes if size is None else size
        self.device = device
        self.owner = owner
        me = weakref.ref(self)
        # The forward's storage: alive past our release => held elsewhere.
        self.storage_ref = weakref.ref(storage, lambda _r: _notify(me, "original_died"))
        self.dev: Optional[torch.Tensor] = None  # flat uint8 over the device storage we hold
        self.host: Optional[HostBlock] = None
        self.d2h: Any = None  # ticket of the copy to host, until checked
        self.h2d: Any = None  # ticket of the copy back, until the compute stream waited on it
        self.versions: list[tuple[weakref.ref, int]] = []
        self.last_access = -1
        self.iteration = iteration
        self.handles = 0  # live Packed handles
        self.alive = True  # False once every handle is gone
        self.on_device = True  # some device storage holds its bytes (the forward's, or a copy we fetched)
        self.copy_ref: Optional[weakref.ref] = None  # the storage of the copy we fetched, while it lives
        self.dev_is_copy = False  # ``dev`` is a copy we fetched (else the forward's own storage)
        self.module = ""
        self._finalizer: Optional[weakref.finalize] = None

    def attach(self, storage: torch.UntypedStorage) -> None:
        with _no_dispatch():  # Note [Views outside the meter]
            self.dev = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        self.dev_is_copy = False

    def original(self) -> Optional[torch.UntypedStorage]:
        """The forward's storage, if it is still alive."""
        return self.storage_ref()

    def adopt_copy(self, flat: torch.Tensor) -> None:
        """``flat`` (a fetched copy) now holds the bytes on the device; watched until it dies."""
        me = weakref.ref(self)
        self.dev = flat
        self.dev_is_copy = True
        self.on_device = True
        self.copy_ref = weakref.ref(flat.untyped_storage(), lambda r: _notify(me, "copy_died", r))

    def note_version(self, t: torch.Tensor) -> None:
        self.versions.append((weakref.ref(t), t._version))

    def unchanged(self) -> bool:
        """No saved tensor of this storage was written in place since it was saved (as far as we can see)."""
        for ref, version in self.versions:
            t = ref()
            if t is not None and t._version != version:
                return False
        return True

    def check_versions(self, when: str = "before its copy to host completed") -> None:
        """Raises if a saved tensor was written in place after it was saved (its copy may be torn, or the
        device storage about to be used is no longer what was saved)."""
        for ref, version in self.versions:
            t = ref()
            if t is not None and t._version != version:
                raise RuntimeError(
                    f"swap: a tensor saved for backward (shape {tuple(t.shape)}, {t.dtype}) was modified in place "
                    f"(version {version} -> {t._version}) {when}. Autograd would reject this too at backward; clone "
                    "the tensor before the in-place op, or exclude it with exclude=."
                )

    def set_host(self, block: HostBlock, free: Callable[[HostBlock], None]) -> None:
        self.host = block
        self._finalizer = weakref.finalize(self, free, block)

    def free_host(self) -> None:
        """Returns the host copy to the pool now (no copy may be in flight)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.host = None

    def take_host(self) -> Optional[HostBlock]:
        """Hands the host block over (to be reused for another variable) instead of freeing it."""
        block, self.host = self.host, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        return block


def _notify(ref: weakref.ref, event: str, *args: Any) -> None:
    var = ref()
    if var is not None and var.owner is not None:
        getattr(var.owner, event)(var, *args)


class Packed:
    """What autograd stores in place of a saved tensor: its variable and its view geometry."""

    __slots__ = ("var", "dtype", "size", "stride", "offset")

    def __init__(self, var: Variable, t: torch.Tensor) -> None:
        self.var = var
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        var.handles += 1

    def __del__(self) -> None:
        var = self.var
        var.handles -= 1
        if var.handles == 0 and var.owner is not None:
            try:
                var.owner.var_dead(var)
            except Exception:  # noqa: BLE001 - a finalizer must not raise (e.g. at interpreter exit)
                pass

    def view_on(self, flat: torch.Tensor) -> torch.Tensor:
        """This saved tensor as a view of the device storage behind ``flat``."""
        with _no_dispatch():  # Note [Views outside the meter]
            return torch.empty(0, dtype=self.dtype, device=flat.device).set_(
                flat.untyped_storage(), self.offset, self.size, self.stride
            )
