"""The host step: the user's optimizer, run on the host masters of the offloaded parameters.

Note [Host step after confirmation]
The host step of a bucket needs its final gradient and the step's scale (the clip coefficient), and both are
certain only at ``opt.step()``. So a step pre-hook on the user's optimizer, at ``opt.step()``: snapshots every
param group's hyperparameters (a scheduler's ``sched.step()`` may change them before the host runs), takes which
host gradients this step has, and queues one host step per bucket, in the order the forward pass uses the buckets,
on the host worker; ``opt.step()`` then returns at once and steps only the parameters still on the device (the
offloaded ones have ``p.grad = None``). The next use of a bucket waits for its update (*update-before-use*), as
does anything that reads parameters in between (a state dict, ``sm.flush()``, the manager's exit), so the host
step hides behind the next forward pass. (By default most of it already ran during the backward, speculatively,
and the step only confirms it: Note [Speculative host steps] in speculation.) It is exact: on CPU runs
parameters and optimizer state are bitwise plain torch's with the kernel the host runs (Note [The host kernel] in
host_optim: the user's optimizer with fused=True, where the user left torch's default).

Note [Shadow optimizer]
The host step is an instance of the user's optimizer class over the host masters, with the user's param groups
(those holding offloaded parameters) and their hyperparameters, copied from the user's groups at every step, so
schedulers, ``add_param_group`` edits and the user's flags (maximize, amsgrad, a kernel chosen by name) take
effect. Host-only changes: ``capturable`` is off (the host runs no CUDA graph), and the kernel is torch's fused
CPU one where the user left torch's default (Note [The host kernel]). One bucket is stepped by pointing each
shadow group's ``params`` at the bucket's parameters in it for the call: the optimizer's state is keyed by
parameter, so buckets can be re-packed at no cost, and one step never touches another bucket's state.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

from . import host_optim
from .speculation import Speculation, SpeculationPolicy, restore, save, saved_bytes

# Optimizers whose step updates each parameter from its own gradient and state only (so a bucket can be stepped
# alone) and that step without a closure; tested bitwise against plain torch.
SUPPORTED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


# Note [Optimizer wrappers]
# accelerate's ``Accelerator.prepare`` hands back the user's optimizer wrapped (``AcceleratedOptimizer``, a
# ``torch.optim.Optimizer`` subclass whose ``param_groups`` and ``state`` are the wrapped optimizer's own objects):
# its ``step`` and ``zero_grad`` call the wrapped optimizer's (or skip them while accumulating), as do its state
# dicts, and accelerate unscales a GradScaler's gradients on the wrapped one. The runtime's hooks (step pre
# and post hooks, ``zero_grad``, state-dict hooks) are per instance, so they go on the wrapped optimizer, where
# they fire whichever object the loop calls; given the wrapper, the class check refused it as an unsupported
# optimizer ("AcceleratedOptimizer is not supported"). So a wrapper that shares its ``param_groups`` with the
# optimizer in its ``optimizer`` attribute is unwrapped first, and the manager given the prepared optimizer or
# its ``.optimizer`` runs the same (tests/trainers/test_model_state_recipes.py).
def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer ``optimizer`` forwards to (Note [Optimizer wrappers]); ``optimizer`` itself if it is none."""
    while isinstance(optimizer, torch.optim.Optimizer):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner.param_groups is not optimizer.param_groups:
            break
        optimizer = inner
    return optimizer


def check_optimizer(optimizer: Any) -> None:
    """Raises for an optimizer whose state the runtime cannot move (saying what to do instead)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("LBFGS re-evaluates the model inside step(closure) and keeps state over all parameters at "
                         "once, so its state cannot be stepped bucket by bucket on the host: keep it on the device "
                         "with model_state=swap.ModelStatePolicy(placement='resident'), or use Adam, AdamW or "
                         "SGD")  # fmt: skip
    if type(optimizer) not in SUPPORTED:
        raise ValueError(f"{type(optimizer).__name__} is not supported for offloaded model state (supported: "
                         f"{', '.join(c.__name__ for c in SUPPORTED)}): keep the state on the device with "
                         "model_state=swap.ModelStatePolicy(placement='resident')")  # fmt: skip


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters as the host step uses them (tensors copied: a scheduler may write them in
    place later); Note [Shadow optimizer]."""
    out = {}
    with _disable_current_modes():
        for k, v in group.items():
            if k == "params":
                continue
            out[k] = v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
    if out.get("capturable"):
        out["capturable"] = False
    return out


class HostStepper:
    """Host steps of ``user`` (the user's optimizer) over ``host_of`` (id(parameter) -> host master), on
    ``worker``; ``grads`` is the gradient sink (swap.runtime.model_state.gradients); ``fast``: torch's fused kernel
    where the user left torch's default (Note [The host kernel]; False: the user's kernel, as FSDP2's HostSteps
    runs it)."""

    def __init__(self, user: torch.optim.Optimizer, host_of: dict[int, torch.Tensor], grads: Any,
                 worker: ThreadPoolExecutor, fast: bool = False) -> None:  # fmt: skip
        self.user = user
        self.fast = fast
        self.host_of = host_of
        self.grads = grads
        self.worker = worker
        self.pending: dict[int, tuple[Future, int]] = {}  # bucket -> its queued host step, and the step's number
        self.seconds: dict[int, float] = {}  # step number -> host optimizer seconds, on the worker
        self.exposed: dict[int, float] = {}  # step number -> seconds something waited for its updates
        self.steps = 0
        # Note [Speculative host steps]: bucket -> its speculation not yet confirmed by opt.step()
        self.specs: dict[int, Speculation] = {}
        self.policy = SpeculationPolicy()
        self.counts = {"speculated": 0, "kept": 0, "rolled_back": 0}
        self.wasted_seconds = 0.0  # host seconds of speculations rolled back (their restores included)
        self.rollback_bytes = 0  # bytes the speculations' copies take now, and their peak
        self.rollback_bytes_peak = 0
        self._spare: dict[int, dict[Any, Any]] = {}  # id(master) -> its copies' buffers, reused at every step
        self._spare_bytes: dict[int, int] = {}
        self._lock = threading.Lock()
        self.overrides: dict[str, Any] = {}  # host-only settings over the user's (Note [Shadow optimizer])
        self.notes: list[str] = []
        # told the host masters a step or a rollback writes, before and after (Note [One cast per master change]
        # in swap.runtime.model_state.storage), on the worker
        self.changed: Callable[[list[torch.Tensor]], None] = lambda masters: None
        self.shadow = self._build()
        host_optim.warn_slow(self.kernel)

    def _build(self) -> torch.optim.Optimizer:
        groups = []
        self.shadow_group: dict[int, int] = {}  # user group -> shadow group
        for g, group in enumerate(self.user.param_groups):
            hosts = [self.host_of[id(p)] for p in group["params"] if id(p) in self.host_of]
            if hosts:
                self.shadow_group[g] = len(groups)
                groups.append({**hyperparameters(group), "params": hosts})
        self.full = [list(g["params"]) for g in groups]
        self.kernel = host_optim.choose(self.user, groups) if self.fast else host_optim.user_kernel(groups)
        try:
            shadow = type(self.user)([{**g, **self.kernel.overrides} for g in groups])
        except (RuntimeError, ValueError) as e:  # a fused kernel the host does not have: the user's own
            if not any(g.get("fused") for g in groups) and "fused" not in self.kernel.overrides:
                raise
            self.kernel = host_optim.fallback(self.user, groups, e)
            shadow = type(self.user)([{**g, **self.kernel.overrides} for g in groups])
        self.overrides.update(self.kernel.overrides)
        if self.kernel.slow is not None:
            self.notes.append(f"the host step runs the {self.kernel.name} kernel, because {self.kernel.slow}")
        return shadow

    # -- queueing ---------------------------------------------------------------------------------------
    def _inputs(self) -> tuple[dict[int, dict[str, Any]], dict[int, int]]:
        """The shadow groups' hyperparameters now, and id(parameter) -> its shadow group."""
        groups = self.user.param_groups
        if len(groups) != len(self.shadow_group) and any(
            any(id(p) in self.host_of for p in g["params"]) for i, g in enumerate(groups) if i not in self.shadow_group
        ):  # fmt: skip
            raise RuntimeError("a param group holding offloaded parameters was added after the manager started: "
                               "add param groups before entering the SwapManager")  # fmt: skip
        hyper = {s: {**hyperparameters(groups[g]), **self.overrides} for g, s in self.shadow_group.items()}
        group_of = {id(p): self.shadow_group[g] for g, grp in enumerate(groups) if g in self.shadow_group
                    for p in grp["params"]}  # fmt: skip
        return hyper, group_of

    def _work(self, params: list[torch.nn.Parameter], group_of: dict[int, int]
              ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:  # fmt: skip
        # Only parameters the user's optimizer steps and that have a gradient (frozen ones have none).
        work = [(group_of[id(p)], self.host_of[id(p)], self.grads.grad(p)) for p in params if id(p) in group_of]
        return [w for w in work if w[2] is not None]

    def queue(self, buckets: dict[int, list[torch.nn.Parameter]]) -> None:
        """Note [Host step after confirmation]: one host step per bucket (its number -> its parameters), in the
        order given; a bucket speculated during the backward is validated instead (Note [Speculative host
        steps]). Every gradient must have landed (``grads.settle()``)."""
        self.steps += 1
        hyper, group_of = self._inputs()
        for b, params in buckets.items():
            work = self._work(params, group_of)
            spec = self.specs.pop(b, None)
            if spec is not None:
                sigs = {id(p): self.grads.signature(p) for p in params}
                self.pending[b] = (self.worker.submit(self._validate, spec, work, hyper, sigs, self.steps),
                                   self.steps)  # fmt: skip
                continue
            if not work:
                continue
            # One worker, first in first out: a step queued earlier for this bucket is done before this one runs.
            self.pending[b] = (self.worker.submit(self._timed_step, work, hyper, self.steps), self.steps)

    # -- speculation (Note [Speculative host steps]) -----------------------------------------------------
    def speculate(self, bucket: int, params: list[torch.nn.Parameter]) -> None:
        """Starts ``bucket``'s host step now, before ``opt.step()`` confirms it."""
        if bucket in self.specs:
            self.rollback(bucket)
        hyper, group_of = self._inputs()
        landings = [f for p in params if (f := self.grads.landing(p)) is not None]
        spec = Speculation(bucket, self.steps + 1, hyper)
        # What the gradients are is decided here, on this thread (the worker may run it after later writes, which
        # the signatures then show); their version counters once the copies landed, on the worker.
        spec.sigs = {id(p): self.grads.signature(p) for p in params}
        work = self._work(params, group_of)
        spec.stepped = [(s, id(hp)) for s, hp, _ in work]
        spec.future = self.worker.submit(self._speculate, spec, params, work, landings)
        self.specs[bucket] = spec
        self.counts["speculated"] += 1

    def _speculate(self, spec: Speculation, params: list[torch.nn.Parameter],
                   work: list[tuple[int, torch.Tensor, torch.Tensor]], landings: list[Future]) -> None:  # fmt: skip
        for f in landings:
            f.result()
        for p in params:
            has, writes, _ = spec.sigs[id(p)]
            spec.sigs[id(p)] = (has, writes, self.grads.signature(p)[2])
        if not work:
            return
        t0 = time.perf_counter()
        masters = [hp for _, hp, _ in work]
        spec.saved = save(self.shadow.state, masters, self._spare)
        self._hold(masters)
        self._step(work, spec.hyper)
        spec.seconds = time.perf_counter() - t0

    def _validate(self, spec: Speculation, work: list[tuple[int, torch.Tensor, torch.Tensor]],
                  hyper: dict[int, dict[str, Any]], sigs: dict[int, Any], number: int) -> None:  # fmt: skip
        try:
            assert spec.future is not None
            spec.future.result()  # done: queued before this one
            ok = spec.holds(sigs, [(s, id(hp)) for s, hp, _ in work], hyper)
        except Exception:  # the speculation raised: undone, and the step made afresh raises what it raises
            ok = False
        if ok:
            self.counts["kept"] += 1
            self.seconds[number] = self.seconds.get(number, 0.0) + spec.seconds
            spec.saved = None
            self.policy.kept()
            return
        self._undo(spec)
        if work:
            self._timed_step(work, hyper, number)

    def _undo(self, spec: Speculation) -> None:
        """The speculation's copies put back (Note [Speculative host steps])."""
        t0 = time.perf_counter()
        if spec.saved is not None:
            masters = [hp for hp, _, _ in spec.saved]
            self.changed(masters)
            try:
                restore(self.shadow.state, spec.saved)
            finally:
                self.changed(masters)
            spec.saved = None
        self.counts["rolled_back"] += 1
        self.wasted_seconds += spec.seconds + time.perf_counter() - t0
        self.policy.failed(spec.number)

    def _hold(self, masters: list[torch.Tensor]) -> None:
        """The rollback buffers' bytes (kept from step to step), after ``masters``' copies were made."""
        with self._lock:
            for hp in masters:
                n = saved_bytes([(hp, *self._spare_pair(hp))])
                self.rollback_bytes += n - self._spare_bytes.get(id(hp), 0)
                self._spare_bytes[id(hp)] = n
            self.rollback_bytes_peak = max(self.rollback_bytes_peak, self.rollback_bytes)

    def _spare_pair(self, hp: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        mine = self._spare[id(hp)]
        return mine[None], {k: v for k, v in mine.items() if k is not None}

    def rollback(self, bucket: int) -> None:
        """``bucket``'s unconfirmed speculation undone (something reads its master before ``opt.step()``)."""
        spec = self.specs.pop(bucket, None)
        if spec is None:
            return
        self._await(spec.future, spec.number)
        self._undo(spec)

    def invalidate(self, bucket: int) -> None:
        """``bucket``'s weights were written: its speculation cannot be kept."""
        spec = self.specs.get(bucket)
        if spec is not None:
            spec.valid = False

    def _await(self, f: Optional[Future], number: int) -> None:
        if f is None:
            return
        if not f.done():
            t0 = time.perf_counter()
            try:
                f.result()
            except Exception:  # noqa: S110 -- a speculation's error is raised again by the step made afresh
                pass
            self.exposed[number] = self.exposed.get(number, 0.0) + time.perf_counter() - t0

    def quiet(self, bucket: int) -> None:
        """Returns once no host work reads ``bucket``'s gradients (its speculation, if any, is kept pending)."""
        spec = self.specs.get(bucket)
        if spec is not None:
            self._await(spec.future, spec.number)
        self.wait(bucket, rollback=False)

    def reading(self, bucket: int) -> list[Future]:
        """The host work that may read ``bucket``'s gradients now."""
        out = [spec.future] if (spec := self.specs.get(bucket)) is not None and spec.future is not None else []
        if (pending := self.pending.get(bucket)) is not None:
            out.append(pending[0])
        return out

    def _timed_step(self, work: list[tuple[int, torch.Tensor, torch.Tensor]], hyper: dict[int, dict[str, Any]],
                    number: int) -> None:  # fmt: skip
        t0 = time.perf_counter()
        try:
            self._step(work, hyper)
        finally:
            self.seconds[number] = self.seconds.get(number, 0.0) + time.perf_counter() - t0

    def _step(self, work: list[tuple[int, torch.Tensor, torch.Tensor]], hyper: dict[int, dict[str, Any]]) -> None:
        shadow = self.shadow
        masters = [hp for _, hp, _ in work]
        self.changed(masters)
        try:
            for s, group in enumerate(shadow.param_groups):
                group.update(hyper[s])
                group["params"] = [hp for g, hp, _ in work if g == s]
            for _, hp, grad in work:
                hp.grad = grad
            shadow.step()
        finally:
            for _, hp, _ in work:
                hp.grad = None
            for s, group in enumerate(shadow.param_groups):
                group["params"] = self.full[s]
            self.changed(masters)

    # -- waiting ----------------------------------------------------------------------------------------
    def updated(self, bucket: int) -> bool:
        pending = self.pending.get(bucket)
        return bucket not in self.specs and (pending is None or pending[0].done())

    def wait(self, bucket: int, rollback: bool = True) -> None:
        """Update-before-use: returns once ``bucket``'s pending host step is done (raising what it raised), its
        unconfirmed speculation undone first (``rollback``)."""
        if rollback:
            self.rollback(bucket)
        pending = self.pending.pop(bucket, None)
        if pending is None:
            return
        f, number = pending
        if not f.done():
            t0 = time.perf_counter()
            f.result()
            self.exposed[number] = self.exposed.get(number, 0.0) + time.perf_counter() - t0
        else:
            f.result()

    def flush(self) -> None:
        for b in list(self.specs):
            self.rollback(b)
        for b in list(self.pending):
            self.wait(b)

    def state_of(self, p: torch.nn.Parameter) -> dict[str, Any]:
        """The host optimizer state of offloaded parameter ``p`` (empty before its first step)."""
        return self.shadow.state.get(self.host_of[id(p)], {})

    def set_state(self, p: torch.nn.Parameter, state: dict[str, Any]) -> None:
        self.shadow.state[self.host_of[id(p)]] = state

    def take_state(self, p: torch.nn.Parameter) -> dict[str, Any]:
        """Removes and returns ``p``'s host state (it becomes resident: the user's optimizer steps it now)."""
        return self.shadow.state.pop(self.host_of[id(p)], {})
