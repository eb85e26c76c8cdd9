"""The manager's saved-tensor hooks, as one object: which saved tensors the executor takes, the rebuilds
that stand in for some of them, and what was left alone and why.

Autograd calls ``pack`` for every tensor it saves for backward while the hooks are installed, and ``unpack``
when backward (or anyone reading ``grad_fn._saved_*``) needs it back. The operator profiler and the recompute
regions (swap.runtime.auto.op_profiler, swap.runtime.auto.regions) are handed this object: ``manages`` says
what it would take, ``keep`` saves a checkpoint's kept output, ``pair`` tells these hooks from a user's own, and
``busy`` says that what runs now runs inside them (the hooks' own copies are not the model's operators).

With model state managed (swap.runtime.model_state), saved tensors that alias a managed parameter's storage go
to its streamer before anything else (whatever their size: the weights behind them leave the device between
uses, so backward must fetch them back), and come back through it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional, Protocol

import torch

from .executor import DECLINED, PROFILE, Executor
from .recompute import RecomputeHooks
from .tracer import Exclusions, is_parameter_like, passthrough


class SaveListener(Protocol):
    """Told of saved tensors while profiling (the joint runtime's operator profiler)."""

    def boundary(self) -> None:
        """An iteration is about to start: the next saved tensor begins it."""

    def saved(self, t: torch.Tensor, packed: Any) -> None:
        """``t`` was saved as ``packed`` in a profiling iteration."""


class ParamSaves(Protocol):
    """Saved views of managed parameters (swap.runtime.model_state.streaming.Streamer)."""

    def pack(self, t: torch.Tensor) -> Any:
        """What autograd keeps for ``t`` if it aliases a managed parameter, else None."""

    def unpack(self, packed: Any) -> torch.Tensor:
        """The saved tensor, its weights on the device."""


class SavedTensorHooks:
    """``pack`` and ``unpack`` for ``torch.autograd.graph.saved_tensors_hooks``, installed by ``install``.

    ``min_bytes`` and ``exclude``: saved storages that stay on the device; ``recompute``: rebuild what can be
    rebuilt (Note [Recompute or swap]). ``skipped`` counts, per reason, the saved tensors left alone in this
    profiling iteration ([count, bytes]); ``profile_skips`` the same for the last finished one;
    ``other_devices`` names devices other than ``device`` that saved tensors were on."""

    def __init__(self, device: torch.device, min_bytes: int, exclude: Exclusions, recompute: bool) -> None:
        self.device = device
        self.min_bytes = min_bytes
        self.exclude = exclude
        self.recompute: Optional[RecomputeHooks] = RecomputeHooks() if recompute else None  # Note [Recompute or swap]
        self.executor: Optional[Executor] = None
        self.listener: Optional[SaveListener] = None
        self.params: Optional[ParamSaves] = None  # model state's saved parameters, when managed
        self._param_packed: Any = ()  # the type of what ``params.pack`` returns
        self.skipped: dict[str, list[int]] = {}  # profiling: why saved tensors stayed -> [count, bytes]
        self.profile_skips: dict[str, list[int]] = {}  # ... in the last profiled iteration
        self.other_devices: set[str] = set()
        self._cpu = device == torch.device("cpu")  # the device check on the hot path
        self._depth = 0  # calls of these hooks under way (``busy``)
        self._context: Any = None

    # -- installing ------------------------------------------------------------------------------------
    def install(self, executor: Executor, listener: Optional[SaveListener] = None) -> None:
        """From now on autograd's saved tensors go through ``executor`` (and ``listener`` hears of them)."""
        self.executor, self.listener = executor, listener
        # Note [Hooks and torch.compile] (swap.runtime.activations.signals): dynamo must run the hooks, not trace them.
        self._context = torch.autograd.graph.saved_tensors_hooks(
            torch._dynamo.disable(self.pack), torch._dynamo.disable(self.unpack)
        )
        self._context.__enter__()

    def uninstall(self, exc_type: Any = None, exc: Any = None, tb: Any = None) -> None:
        """Autograd's saved tensors stay where they are again (also after an exception)."""
        try:
            if self._context is not None:
                self._context.__exit__(exc_type, exc, tb)
        finally:
            self._context = None

    @property
    def pair(self) -> Any:
        """The (pack, unpack) pair autograd calls, to tell our hooks from others (Note [Whose checkpoint])."""
        c = self._context
        return (c.pack_hook, c.unpack_hook) if c is not None else None

    @property
    def busy(self) -> bool:
        """Whether the caller runs inside these hooks (the operator profiler skips what runs there)."""
        return self._depth > 0

    def manage_params(self, params: Optional[ParamSaves], packed_type: Any = ()) -> None:
        """Saved tensors aliasing managed parameters go to ``params`` (which packs them as ``packed_type``);
        None: no longer (the hooks must not keep the model alive once the manager has exited)."""
        self.params, self._param_packed = params, packed_type

    @contextlib.contextmanager
    def own_work(self) -> Iterator[None]:
        """The manager's own operators run inside: ``busy`` while they do."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def enable_rebuilds(self) -> RecomputeHooks:
        """Turns rebuilds on (a joint plan chose them), if they are not on already."""
        if self.recompute is None:
            self.recompute = RecomputeHooks()
        return self.recompute

    # -- which tensors ---------------------------------------------------------------------------------
    def skip_reason(self, t: torch.Tensor, min_bytes: Optional[int] = None) -> Optional[str]:
        """Why a saved tensor stays where it is (None: the executor takes it), with ``min_bytes`` (None: the
        manager's). Cheapest checks first."""
        if not t.is_cpu if self._cpu else t.device != self.device:
            return "device"
        n = t.untyped_storage().nbytes()
        if n < (self.min_bytes if min_bytes is None else min_bytes) or n == 0:
            return "min_bytes" if n else "other"
        if is_parameter_like(t):
            return "parameter"
        if type(t) is not torch.Tensor or t.layout != torch.strided:
            return "other"
        if 0 in t.stride() and t.numel() > 1:
            return "expanded"  # copying it back could not restore the aliasing
        if self.exclude and self.exclude(t):
            return "exclude"
        return None

    def manages(self, t: torch.Tensor) -> bool:
        """Whether the executor would take ``t`` as a variable."""
        return self.skip_reason(t) is None

    def end_profile(self) -> dict[str, list[int]]:
        """A profiling iteration ended: its skip counts become ``profile_skips`` (returned); the next counts afresh."""
        self.profile_skips, self.skipped = self.skipped, {}
        return self.profile_skips

    # -- the hooks -------------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        listener = self.listener
        if listener is None:
            return self._take(t)
        ex = self.executor
        if ex.between_iterations:
            listener.boundary()
        self._depth += 1
        try:
            packed = self._take(t)
        finally:
            self._depth -= 1
        if ex.mode == PROFILE:
            listener.saved(t, packed)
        return packed

    def keep(self, t: torch.Tensor) -> Any:
        """A kept operator's output in a recompute region (swap.runtime.auto.regions): saved like any saved tensor,
        never rebuilt (its producer's saved input lives in the checkpoint, out of our reach)."""
        self._depth += 1
        try:
            return self._take(t, rebuild=False)
        finally:
            self._depth -= 1

    def unpack(self, packed: Any) -> torch.Tensor:
        self._depth += 1
        try:
            if type(packed) is self._param_packed:
                t = self.params.unpack(packed)
                return self.executor.unpack(t)  # not the executor's: it only learns that a backward pass runs
            if self.recompute is not None and self.recompute.intercepts(packed):
                return self.recompute.unpack(packed, self.executor.unpack)
            return self.executor.unpack(packed)
        finally:
            self._depth -= 1

    def _take(self, t: torch.Tensor, rebuild: bool = True) -> Any:
        ex = self.executor
        if self.params is not None and (packed := self.params.pack(t)) is not None:
            ex.observe(t)  # it still marks where iterations begin
            return packed
        recompute = self.recompute
        if ex.mode == DECLINED and recompute is None and not ex.between_iterations:
            return ex.pack(t)  # at a boundary, the next iteration may have a plan (Note [Plans by input shape])
        reason = self.skip_reason(t)
        if reason == "min_bytes" and ex.expects(t):  # Note [A plan's variables, whatever their size]
            reason = self.skip_reason(t, min_bytes=1)
        if reason is None:
            if rebuild and recompute is not None and (rebuilt := recompute.pack(t)) is not None:
                return rebuilt
            return ex.pack(t)
        if rebuild and recompute is not None:
            recompute.saving()  # a node's saved input we keep may still be a rebuild's source
        ex.observe(t)
        if ex.mode == PROFILE:
            self._note_skip(t, reason)
        return passthrough(t)

    def _note_skip(self, t: torch.Tensor, reason: str) -> None:
        if reason == "device":
            self.other_devices.add(str(t.device))
            return
        if reason in ("min_bytes", "exclude"):
            self.executor.note_kept(t)
        entry = self.skipped.setdefault(reason, [0, 0])
        entry[0] += 1
        entry[1] += t.untyped_storage().nbytes()
