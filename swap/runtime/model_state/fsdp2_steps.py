"""The host step of FSDP2 units offloaded by ``swap.fsdp2.shard``: taken out of the user's ``opt.step()`` and run
on a host worker after the step confirms, each unit's next forward waiting for its own update.

Note [Host steps of offloaded FSDP2 units]
The single-device model-state runtime's host step (Note [Host step after confirmation], Note [Shadow
optimizer]) runs here unchanged, on what FSDP2's offload already put on the host:
- the host master of an offloaded parameter is the parameter itself: FSDP2's ``CPUOffloadPolicy`` keeps the
  rank's shard on the host as a sharded DTensor, and FSDP2 copies it to the device before each all-gather. The
  shadow optimizer steps a detached alias of it (same storage, same DTensor layout), so the user's parameter
  and its ``.grad`` are never touched by the worker;
- its gradient is the one FSDP2 copied to the host after the reduce-scatter (``p.grad``). At ``opt.step()``
  (a step pre-hook) the offloaded parameters' gradients are taken and ``p.grad`` set to None for the call, so
  the user's optimizer steps only the resident units; the step post-hook gives the gradients back, as plain
  training leaves them;
- the host steps are queued in forward order (the order of ``ShardPlan.placements``) on one worker;
  ``gate_updates`` makes every unshard of an offloaded unit (its pre-forward's, a forward prefetch's, a user's
  ``unshard()``: Note [Every unshard gated]) wait for that unit's update (update-before-use), so the host step
  hides behind the forward of the units before;
- optimizer state stays in the user's optimizer: each offloaded parameter's state dict is one object shared
  by the user's ``opt.state`` and the shadow's (linked on the main thread once the host step made it, and
  again after ``opt.load_state_dict``), so ``opt.state_dict()``, ``get_state_dict`` and DCP see plain FSDP2
  state (sharded DTensors) and the same step counts;
- anything that reads parameters or state waits for the pending steps first: the model's and the optimizer's
  ``state_dict`` / ``load_state_dict`` (pre-hooks), ``zero_grad(set_to_none=False)`` (it writes the gradients
  the worker reads), ``flush()`` and ``close()``.
On CPU runs the shadow runs the user's very kernel on the same shard, so training is bitwise equal to FSDP2
without offload (tested on two ranks, with clipping across ranks and an LR scheduler).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch

from ...schedule.model_state.units import ShardPlan
from .host_optim import host_worker
from .host_step import HostStepper, check_optimizer


def gate_updates(model: torch.nn.Module, plan: ShardPlan, wait: Callable[[str], None]) -> list[Any]:
    """Before FSDP2 all-gathers an offloaded unit, ``wait(path)`` (the host update of that unit must be done: Note
    [Model state under FSDP2], Note [Every unshard gated]). Returns handles (``.remove()`` them)."""
    modules = dict(model.named_modules())
    handles: list[Any] = []
    for path in plan.offloaded:
        group = _param_group(modules[path])
        if group is not None:
            handles.append(_GatedUnshard(group, lambda path=path: wait(path)))
            continue

        def pre(module: torch.nn.Module, args: Any, path: str = path) -> None:  # a unit not sharded (yet)
            wait(path)

        handles.append(modules[path].register_forward_pre_hook(pre, prepend=True))
    return handles


# Note [Every unshard gated]
# A unit's forward pre-hook is not the only place FSDP2 copies its host shard to the device and all-gathers it:
# with explicit forward prefetch (``set_modules_to_forward_prefetch``) unit i's pre-forward unshards unit i+1, and
# a user's ``module.unshard()`` does it whenever it is called. A gate on unit i+1's own pre-hook then ran after
# the copy had read the shard, which the host step might still be writing (torn weights). Every one of those
# paths ends in the unit's ``FSDPParamGroup.unshard`` (its own pre-forward, ``_prefetch_unshard``,
# ``FSDPModule.unshard``, the backward's), so that is what is gated: an instance attribute over the method,
# waiting for the unit's update, then unsharding. Outside the span from ``opt.step()`` to the unit's next use
# nothing is pending and the wait returns at once.
def _param_group(module: torch.nn.Module) -> Any:
    """``module``'s FSDP2 parameter group (None: not a FSDP2 unit, or one without parameters)."""
    state = getattr(module, "_get_fsdp_state", None)
    return None if state is None else getattr(state(), "_fsdp_param_group", None)


class _GatedUnshard:
    """``group.unshard`` waits for ``wait()`` first (Note [Every unshard gated]) until ``remove()``."""

    def __init__(self, group: Any, wait: Callable[[], None]) -> None:
        self.group = group
        original = group.unshard

        def unshard(*args: Any, **kwargs: Any) -> Any:
            wait()
            return original(*args, **kwargs)

        group.unshard = unshard

    def remove(self) -> None:
        vars(self.group).pop("unshard", None)


def unit_parameters(model: torch.nn.Module, plan: ShardPlan) -> dict[str, list[torch.nn.Parameter]]:
    """Each unit's own parameters (those of no unit nested in it; the root's: those of no other unit), per unit
    path of ``plan`` in forward order."""
    by_length = sorted((u for u in plan.placements if u), key=len, reverse=True)
    out: dict[str, list[torch.nn.Parameter]] = {u: [] for u in plan.placements}
    for name, p in model.named_parameters():
        out[next((u for u in by_length if name.startswith(u + ".")), "")].append(p)
    return out


class HostSteps:
    """Steps the offloaded units of ``plan`` on the host after ``optimizer.step()`` confirms (Note [Host steps of
    offloaded FSDP2 units]). Build it after ``shard`` and the optimizer; use it as a context manager (or call
    ``close()``), around the training loop."""

    def __init__(self, model: torch.nn.Module, plan: ShardPlan, optimizer: torch.optim.Optimizer) -> None:
        check_optimizer(optimizer)
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
        units = unit_parameters(model, plan)
        self.model, self.optimizer = model, optimizer
        self.buckets = {b: [p for p in units[u] if id(p) in owned] for b, u in enumerate(plan.offloaded)}
        self.index = {u: b for b, u in enumerate(plan.offloaded)}
        self.params = [p for ps in self.buckets.values() for p in ps]
        self.host_of = {id(p): p.detach() for p in self.params}
        self.taken: dict[int, torch.Tensor] = {}  # id(p) -> the gradient taken at the step in progress
        threads = plan.policy.host_threads if plan.policy is not None else None
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="swap-fsdp2-host-step") if threads is None else \
            host_worker(torch.device("cpu"), threads)[0]  # the policy's threads (Note [Host threads])
        self.stepper = HostStepper(optimizer, self.host_of, self, self.worker)
        self._restore: list[Callable[[], None]] = []
        self._link_shadow()
        handles = [optimizer.register_step_pre_hook(self._pre_step), optimizer.register_step_post_hook(self._post_step),
                   optimizer.register_state_dict_pre_hook(lambda opt: self.flush()),
                   optimizer.register_load_state_dict_pre_hook(lambda opt, sd: self.flush()),
                   optimizer.register_load_state_dict_post_hook(lambda opt: self._link_shadow(loaded=True)),
                   model.register_state_dict_pre_hook(lambda *args: self.flush()),
                   model.register_load_state_dict_pre_hook(lambda *args: self.flush()),
                   *gate_updates(model, plan, self.wait)]  # fmt: skip
        self._restore += [h.remove for h in handles]
        for obj in (optimizer, model):
            self._wrap_zero_grad(obj)

    # -- the gradient sink the host step reads (swap.runtime.model_state.host_step.HostStepper) ------------------
    def grad(self, p: torch.nn.Parameter) -> Optional[torch.Tensor]:
        return self.taken.get(id(p))

    # -- the optimizer step ---------------------------------------------------------------------------------
    def _pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:
            raise RuntimeError("opt.step(closure) re-evaluates the model inside the step, and offloaded FSDP2 units "
                               "are stepped on the host after their gradients are final: call the closure yourself "
                               "(loss = closure()), then opt.step()")  # fmt: skip
        self._link_shadow()
        for p in self.params:
            if p.grad is not None:
                self.taken[id(p)] = p.grad
                p.grad = None
        try:
            self.stepper.queue(self.buckets)
        except BaseException:  # the step does not happen: the gradients stay where they were
            self._post_step(optimizer, args, kwargs)
            raise

    def _post_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        for p in self.params:  # the gradients back where plain training leaves them; the host step reads them too
            if id(p) in self.taken:
                p.grad = self.taken[id(p)]
        self.taken = {}

    # -- the optimizer state, one object for the user's optimizer and the shadow ----------------------------------
    def _link_shadow(self, loaded: bool = False) -> None:
        """The shadow's state of each offloaded parameter is the user's; after a load (``loaded``, nothing
        pending: the load waited), the loaded one, and none where the load brought none."""
        user, shadow = self.optimizer.state, self.stepper.shadow.state
        for p in self.params:
            hp = self.host_of[id(p)]
            if p in user:
                if shadow.get(hp) is not user[p]:
                    shadow[hp] = user[p]
            elif loaded:
                shadow.pop(hp, None)

    def _link_user(self, bucket: int) -> None:
        """State the host step made for ``bucket`` (its first step) shows in the user's ``opt.state``."""
        user, shadow = self.optimizer.state, self.stepper.shadow.state
        for p in self.buckets[bucket]:
            state = shadow.get(self.host_of[id(p)])
            if state is not None and user.get(p) is not state:
                user[p] = state

    # -- waiting --------------------------------------------------------------------------------------------
    def wait(self, unit: str) -> None:
        """Update-before-use: returns once the pending host step of ``unit`` (a path of the plan) is done."""
        b = self.index[unit]
        self.stepper.wait(b)
        self._link_user(b)

    def flush(self) -> None:
        """Every pending host step done (the parameters and ``opt.state`` are current)."""
        for unit in self.index:
            self.wait(unit)

    def _wrap_zero_grad(self, obj: Any) -> None:
        original, had_own = obj.zero_grad, "zero_grad" in vars(obj)

        def zero_grad(set_to_none: bool = True, *args: Any, **kwargs: Any) -> None:
            if not set_to_none:  # zeroes the gradients in place, which a pending host step may still read
                self.flush()
            original(set_to_none, *args, **kwargs)

        obj.zero_grad = zero_grad
        self._restore.append(lambda: setattr(obj, "zero_grad", original) if had_own else delattr(obj, "zero_grad"))

    # -- what it did, closing ----------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """Per optimizer step (its number): host step seconds on the worker, and the part the gates waited for."""
        s = self.stepper
        return {"host_step_seconds": dict(s.seconds), "host_step_exposed_seconds": dict(s.exposed),
                "notes": list(s.notes)}  # fmt: skip

    def close(self) -> None:
        """Pending host steps done, hooks removed: the optimizer steps every unit itself again."""
        if self.worker is None:
            return
        try:
            self.flush()
        finally:
            for undo in reversed(self._restore):
                undo()
            self._restore = []
            self.worker.shutdown(wait=True)
            self.worker = None

    def __enter__(self) -> HostSteps:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
