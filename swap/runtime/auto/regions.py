"""Recompute regions at run time: the chosen modules' forward under non-reentrant ``torch.utils.checkpoint``,
with our own selective contexts, applied to a model the manager did not write (Note [Recompute regions] in
swap.joint.regions says what the sequence then looks like).

Note [Selective recompute that stays swappable]
torch's own selective checkpointing (``create_selective_checkpoint_contexts``) keeps the outputs it saves in
its own cache, which the swap runtime never sees: they could not be swapped, and they count against the
budget as memory nobody may move (a survey of other recompute tools measured it). So the contexts here
hand those outputs to the swap manager instead:
- ``KeepContext`` (the checkpoint's forward context) runs every operator; for an operator the plan keeps
  (or one that cannot be rerun, Note [Operators that cannot be rerun]) it gives the outputs to the manager,
  a save step like any saved tensor, and remembers the handles under the operator's key: (name, ordinal of
  that name within the call). Per-name ordinals, as torch's SAC does: the rerun's own ``detach`` calls and
  other ignored operators then cannot shift them.
- ``RerunContext`` (the recompute context) returns, for the same key, the manager's unpack of the handle (a
  use step, which the plan prefetches) instead of running the operator; every other operator runs again.
The handles live as long as the checkpoint's frame, so a second backward over a retained graph finds them
too.

Note [Scratch copies]
A rerun operator that writes a tensor from outside the rerun would write it twice: BatchNorm's running
statistics (``native_batch_norm`` updates them in place when training), a step counter buffer. The rerun
therefore gives such an operator a copy of every tensor it writes that the rerun did not make itself, and
drops the copy afterwards; writes to tensors the rerun made (``relu_`` on a fresh output) go ahead as usual.
An operator writing one of the region's inputs makes the module ineligible instead (swap.runtime.auto.op_profiler).

Note [Rerun timing]
Each rerun is timed between two timer marks (CUDA events on a GPU). A region reruns every iteration, so marks
kept until the report would pile up (two events per region per iteration, for the life of the manager) and
the report would make the host wait for every one. So each rerun's end folds the marks the device has
already passed into a running sum of seconds (``RegionStats.rerun_done``) and drops them: only reruns still in
flight keep their marks, and the report waits for those few alone.

Note [Whose checkpoint]
A module runs under our checkpoint only when our saved-tensor hooks are the innermost ones: inside a user's
own ``torch.utils.checkpoint`` (or ``save_on_cpu``) it runs as the user wrote it, so their checkpoint keeps
working and ours is never nested in it. The profiler marks such modules ineligible in the first place.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import SAC_IGNORED_OPS, checkpoint

from ...joint.regions import RecomputePlan, Region
from ..activations.hooks import SavedTensorHooks
from ..machine.timers import CudaStepTimer, HostStepTimer
from .op_facts import blocker, replace_written, stateful_argument, tensors_of

log = logging.getLogger("swap")

Key = tuple[str, int]


@dataclass
class RegionStats:
    """Per region path, over the run."""

    calls: int = 0
    reruns: int = 0
    rerun_marks: list = field(default_factory=list)  # timer marks of reruns still in flight (Note [Rerun timing])
    rerun_done: float = 0.0  # seconds of the reruns whose marks were folded in
    forced: dict[str, str] = field(default_factory=dict)  # operator key -> why it cannot be rerun
    scratch: int = 0  # tensors written on scratch copies (Note [Scratch copies])
    skipped: int = 0  # calls run unwrapped (an argument the rerun could change twice)


def innermost_hooks_are(ours: Any) -> bool:
    """Whether the innermost saved-tensor hooks are ``ours`` (the manager's (pack, unpack) pair, None when it
    has none): not a user's ``torch.utils.checkpoint`` or ``save_on_cpu`` inside them (Note [Whose checkpoint])."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is not None and top == ours


class _Counter:
    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def key(self, func: Any) -> Key:
        name = str(func)
        k = self.seen.get(name, 0)
        self.seen[name] = k + 1
        return name, k


class KeepContext(TorchDispatchMode):
    """The checkpoint's forward context (Note [Selective recompute that stays swappable])."""

    def __init__(self, call: _Call) -> None:
        super().__init__()
        self.call = call
        self.counter = _Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in SAC_IGNORED_OPS:
            return out
        key = self.counter.key(func)
        call = self.call
        why = blocker(func, args, kwargs, call.owner.device)  # Note [Operators that cannot be rerun]
        if why:
            call.owner.stats(call.path).forced.setdefault(f"{key[0]}#{key[1]}", why)
        elif key not in call.keep:
            return out
        leaves, spec = tree_flatten(out)
        call.store[key] = (spec, [(True, call.owner.hooks.keep(x)) if isinstance(x, torch.Tensor) else (False, x)
                                  for x in leaves])  # fmt: skip
        return out


class RerunContext(TorchDispatchMode):
    """The checkpoint's recompute context (Note [Selective recompute that stays swappable], [Scratch copies])."""

    def __init__(self, call: _Call) -> None:
        super().__init__()
        self.call = call
        self.counter = _Counter()
        self.made: set[int] = set()  # ids of storages the rerun made (live ones: an id is not reused while alive)

    def __enter__(self) -> RerunContext:
        self.counter = _Counter()
        self.made = set()
        owner = self.call.owner
        owner.timer.start()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        owner = self.call.owner
        stats = owner.stats(self.call.path)
        stats.reruns += 1
        stats.rerun_marks.append(owner.timer.stop())
        owner.fold(stats)

    def _note(self, value: Any) -> None:
        for t in tensors_of(value):
            self.made.add(id(t.untyped_storage()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        if func in SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        key = self.counter.key(func)
        stored = self.call.store.get(key)
        if stored is not None:
            spec, leaves = stored
            unpack = self.call.owner.hooks.unpack
            value = tree_unflatten([unpack(x) if is_tensor else x for is_tensor, x in leaves], spec)
            self._note(value)
            return value
        args, kwargs = replace_written(func, args, kwargs, self._scratch)
        out = func(*args, **kwargs)
        self._note(out)
        return out

    def _scratch(self, t: torch.Tensor) -> torch.Tensor:
        if id(t.untyped_storage()) in self.made:
            return t
        self.call.owner.stats(self.call.path).scratch += 1
        return t.clone()


@dataclass
class _Call:
    """One call of a checkpointed module: what its contexts share."""

    owner: Regions
    path: str
    keep: frozenset
    store: dict = field(default_factory=dict)


class Regions:
    """Wraps and unwraps modules' forward (Note [Selective recompute that stays swappable], [Whose checkpoint]).

    ``hooks``, the manager's saved-tensor hooks: ``keep(t)`` hands them a kept output and returns its handle,
    ``unpack(handle)`` reads it back, and ``pair`` tells them from a user's own."""

    def __init__(self, hooks: SavedTensorHooks, device: torch.device) -> None:
        self.hooks, self.device = hooks, device
        self.plan: Optional[RecomputePlan] = None
        self.timer: Any = CudaStepTimer(device) if device.type == "cuda" else HostStepTimer()
        self._stats: dict[str, RegionStats] = {}
        self._wrapped: list[tuple[torch.nn.Module, Any, bool]] = []  # (module, previous forward attr, had attr)

    def stats(self, path: str) -> RegionStats:
        return self._stats.setdefault(path, RegionStats())

    def stats_of(self, path: str) -> Optional[RegionStats]:
        """What ``path``'s region did over the run, if it ran at all."""
        return self._stats.get(path)

    @property
    def applied(self) -> bool:
        """Whether modules are wrapped now."""
        return bool(self._wrapped)

    def apply(self, plan: RecomputePlan, modules: dict[str, torch.nn.Module]) -> None:
        """Wraps the forward of each region's module (``modules``: path -> module)."""
        if self._wrapped:
            raise RuntimeError("regions are already applied")
        missing = [r.path for r in plan.regions if r.path not in modules]
        if missing:
            raise ValueError(f"no module at {', '.join(missing)} (the paths come from the profiled model)")
        self.plan = plan
        for region in plan.regions:
            m = modules[region.path]
            had = "forward" in m.__dict__
            self._wrapped.append((m, m.__dict__.get("forward"), had))
            m.forward = self._wrap(region, m.forward)
        log.info("swap: checkpointing %s", plan.describe())

    def remove(self) -> None:
        """Gives every wrapped module its own forward back (also after an exception)."""
        for m, previous, had in reversed(self._wrapped):
            if had:
                m.forward = previous
            else:
                m.__dict__.pop("forward", None)
        self._wrapped = []

    def _wrap(self, region: Region, forward: Callable) -> Callable:
        path, keep = region.path, frozenset(region.keep)

        @functools.wraps(forward)
        def checkpointed(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled() or not innermost_hooks_are(self.hooks.pair):
                return forward(*args, **kwargs)  # Note [Whose checkpoint]
            leaves, spec = tree_flatten((args, kwargs))
            if stateful_argument(leaves):  # profiled without one; this call has one: run it as written
                self.stats(path).skipped += 1
                return forward(*args, **kwargs)
            where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
            # The closure must hold no tensor: the checkpoint's frame keeps it until the backward.
            shell = [None if isinstance(x, torch.Tensor) else x for x in leaves]

            def run(*tensors: torch.Tensor) -> Any:
                filled = list(shell)
                for i, t in zip(where, tensors):
                    filled[i] = t
                a, k = tree_unflatten(filled, spec)
                return forward(*a, **k)

            self.stats(path).calls += 1
            call = _Call(self, path, keep)
            return checkpoint(run, *[leaves[i] for i in where], use_reentrant=False, preserve_rng_state=True,
                              context_fn=lambda: (KeepContext(call), RerunContext(call)))  # fmt: skip

        return checkpointed

    def fold(self, stats: RegionStats) -> None:
        """Folds the marks of finished reruns into ``stats.rerun_done`` and drops them (Note [Rerun timing])."""
        pending = []
        for mark in stats.rerun_marks:
            if self.timer.done(mark):
                stats.rerun_done += self.timer.resolve(mark)
            else:
                pending.append(mark)
        stats.rerun_marks = pending

    def rerun_seconds(self, path: str) -> float:
        """Seconds spent rerunning ``path`` over the run (CUDA events on a GPU): waits only for the reruns still
        in flight (Note [Rerun timing])."""
        s = self.stats_of(path)
        if s is None:
            return 0.0
        self.fold(s)
        return s.rerun_done + sum(self.timer.resolve(m) for m in s.rerun_marks)
