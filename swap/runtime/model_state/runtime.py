"""The model-state runtime: the user's parameters, gradients and optimizer state placed and updated under the
manager's budget. It wires the parts, each in its own module: entries and buckets (``buckets``), host masters and
device copies (``storage``), the parameter guard (``guard``), streaming (``streaming``), gradients
(``gradients``), the host step (``host_step``), state dicts (``state_dicts``), clipping (``clipping``) and host
memory (``host_memory``). The manager builds it when given ``model=`` and ``optimizer=``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...schedule.model_state import ModelStatePlan, ModelStatePolicy, Placement, UpdateSite, default_bucket_bytes
from ...units import fmt_bytes
from ..machine.host_pool import ALIGN, HostPool, Pinner
from ..machine.resources import available_host_memory
from . import clipping, scaling
from .buckets import collect_entries, specs, trains
from .data_parallel import refuse_compiled, refuse_ddp, refuse_ddp_forward
from .gradients import GradSink, set_raw_grad
from .guard import ParamGuard
from .host_memory import predict, refuse_over, speculates
from .host_optim import host_worker
from .host_step import HostStepper, check_optimizer, unwrap_optimizer
from .precision import cast_forward_inputs, check_masters, precision_name
from .state_dicts import StateDictHooks, host_state_value
from .storage import Copies, Masters
from .streaming import Streamer
from .weight_hooks import WeightHooks


def device_state_value(key: str, value: Any, p: torch.nn.Parameter, group: dict[str, Any]) -> Any:
    """A host state value for resident parameter ``p``, as torch's ``Optimizer.load_state_dict`` places it (a
    copy, made on this thread, where a meter counting the device sees it)."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        if group.get("capturable") or group.get("fused"):
            return value.to(dtype=torch.float32, device=p.device, copy=True)
        return value.clone()
    return value.to(dtype=p.dtype if p.is_floating_point() else value.dtype, device=p.device, copy=True)


def check_model_state(model: Any, optimizer: Any, policy: ModelStatePolicy) -> Optional[ModelStatePolicy]:
    """``model=``, ``optimizer=`` and the policy (swap.ModelStatePolicy): the policy to run (None: no model state
    managed). Raises, saying what to change, for a model without its optimizer."""
    if model is None and optimizer is None:
        return None
    if model is None or optimizer is None:
        given, missing = ("model", "optimizer") if optimizer is None else ("optimizer", "model")
        raise ValueError(f"{given}= was given without {missing}=: the manager places a model's state only with "
                         "the optimizer that steps it; pass both, or neither (then only activations are managed)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
    if policy.offloads:
        check_optimizer(unwrap_optimizer(optimizer))  # Note [Optimizer wrappers] in host_step
        refuse_ddp(model)
        refuse_compiled(model)
    return policy


class ModelStateRuntime:
    """Streams ``model``'s parameters that ``optimizer`` steps (every bucket ``STREAMED``, host step after
    confirmation: the conservative plan, until the policy's placement is applied) on ``device``, as ``policy``
    says: buckets of about ``policy.bucket_bytes`` (None: from the weights and ``budget``, Note [Bucket size by
    default]), ``policy.host_memory`` host bytes at most (None: what is available now), ``policy.host_threads``,
    ``policy.compute_dtype`` (fp32 masters on the host, device copies in this dtype: Note [Mixed precision] in
    swap.runtime.model_state.precision; None: the parameters' own dtype). Raises ``HostMemoryError`` before
    allocating anything when the state would not fit."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 policy: Optional[ModelStatePolicy] = None, budget: Optional[int] = None) -> None:  # fmt: skip
        policy = self.policy = policy if policy is not None else ModelStatePolicy(placement="streamed")
        self.mode = policy.placement
        bucket_bytes, host_memory, compute_dtype = policy.bucket_bytes, policy.host_memory, policy.compute_dtype
        self.model = model
        optimizer = self.optimizer = unwrap_optimizer(optimizer)  # Note [Optimizer wrappers] in host_step
        self.device = device
        self.compute_dtype = compute_dtype
        self.entries = collect_entries(model, optimizer, device, compute_dtype)
        if not self.entries:
            raise ValueError("the optimizer steps none of the model's parameters: nothing to place")
        if compute_dtype is not None:
            check_masters(self.entries, compute_dtype)
        self.precision = precision_name(self.entries, compute_dtype)
        if bucket_bytes is None:  # Note [Bucket size by default]
            bucket_bytes = default_bucket_bytes(sum(e.nbytes for e in self.entries), budget)
        self.bucket_bytes = bucket_bytes
        self.prediction = predict(self.entries, optimizer, bucket_bytes)
        limit = host_memory if host_memory is not None else available_host_memory()
        refuse_over(self.prediction, limit, "the policy's host_memory=" if host_memory is not None else
                    "the host memory available now (MemAvailable)")  # fmt: skip
        # Note [When to speculate]: on where the rollback copies fit beside the rest (set it False to turn it off)
        self.speculate = speculates(self.prediction.total, self.prediction.rollback, limit)
        self.speculate_note = None if self.speculate else (
            f"no speculative host steps: their rollback copies ({fmt_bytes(self.prediction.rollback)}) do not fit "
            f"beside the model state in {fmt_bytes(limit)} of host memory")  # fmt: skip
        self.copies = Copies()
        self.pools: list[HostPool] = []
        self.worker: Optional[ThreadPoolExecutor] = None
        self.records: list[dict[str, Any]] = []
        self._restore: list[Callable[[], None]] = []
        self._last = self._totals(lambda: (0, 0))
        self._user_flags: Optional[list[dict[str, Any]]] = None  # Note [One kernel on a CPU run]
        self.started = False
        self.final: Optional[dict[str, Any]] = None
        self.plan: Optional[ModelStatePlan] = None  # the plan applied (None: the conservative one, all streamed)
        self._proposed: Optional[ModelStatePlan] = None
        # Asked at each optimizer step until it returns a plan (the manager's, once the activations are planned).
        self.decide: Optional[Callable[[list[Any]], Optional[ModelStatePlan]]] = None
        # What ``decide`` chose, how, and the prices it used (Note [Placing model state under the budget] in
        # swap.runtime.model_state.wiring): the report's ``choice``.
        self.choice: Optional[dict[str, Any]] = None
        # Page-locks the host masters and gradient buffers: the CUDA driver on CUDA runs (None), or one given
        # (tests, a host with its own way to pin).
        self.pinner: Optional[Pinner] = None

    # -- starting ---------------------------------------------------------------------------------------
    def start(self, engine: Any, own_work: Callable[[], Any], fits: Callable[[int], bool],
              activation_bytes: Callable[[], tuple[int, int]],
              settle: Callable[[], Any] = lambda: None) -> None:  # fmt: skip
        """Host masters and buffers allocated, weights dropped off the device, hooks installed. ``own_work()``: a
        context in which the saved-tensor hooks know the runtime's own operators run; ``fits(n)``: whether ``n``
        more device bytes keep the budget; ``activation_bytes()``: activation bytes (in, out) so far;
        ``settle()``: reads the device memory's window (Note [The model as it enters] in storage)."""
        pinned = self.pinned
        pred = self.prediction
        # Exact sizes, one block each (Note [Host memory before allocating]); the accumulation buffer may not grow
        # past its own. Under mixed precision the compute copies and the accumulation buffer are what the link
        # reads and writes: only they are pinned.
        sizes = ((pred.masters, False, not pred.mixed), (pred.grads, False, not pred.mixed),
                 (pred.accumulation, True, True), (pred.copies, False, True))  # fmt: skip
        pools = [HostPool(pinned and pin, limit=n if limited else None, block_size=max(n, ALIGN), pinner=self.pinner,
                          device=self.device)
                 for n, limited, pin in sizes]  # fmt: skip
        self.pools = pools
        self.activation_bytes = activation_bytes
        self.worker, self.host_threads = host_worker(self.device, self.policy.host_threads)  # Note [Host threads]
        self.lane = ThreadPoolExecutor(1, thread_name_prefix="swap-grad-lane")  # gradients' copies and adds
        entries, copies = self.entries, self.copies
        self.guard = ParamGuard({}, self._dropped, self._demand, self._wrote, self._landed)
        self._own_work = own_work
        self.masters = Masters(entries, pools[0], engine, self.device, self.busy, copies, compute=pools[3])
        self.masters.allocate()
        self.grads = GradSink(entries, pools[1], pools[2], engine, self.lane,
                              lambda i: self.stepper.quiet(self.streamer.bucket_of[i]),
                              lambda: self.streamer.in_backward(), copies, self.busy, self._grad_arrived,
                              lambda i: self.stepper.reading(self.streamer.bucket_of[i]),
                              self.bucket_bytes, fits)  # fmt: skip
        self.grads.allocate()
        host_of = {id(p): self.masters.host_param(e, p) for e in entries for _, p in e.params}
        self.host_of = host_of
        self.stepper = HostStepper(self.optimizer, host_of, self.grads, self.worker, fast=True)
        self.stepper.policy.enabled = self.speculate
        entry_of_host = {id(host_of[id(p)]): e for e in entries for _, p in e.params}
        self.stepper.changed = lambda hosts: [self.masters.changed(entry_of_host[id(h)]) for h in hosts]
        if self.speculate_note is not None:
            self.stepper.notes.append(self.speculate_note)
        self._handed_out: dict[int, list[weakref.ref]] = {}  # Note [Masters handed out]: entry -> tensors
        self._arrived: set[int] = set()  # parameters whose gradient arrived in this backward
        self._specced: set[int] = set()  # buckets speculated in this backward
        self._needed: tuple[Any, dict[int, list[torch.nn.Parameter]]] = (None, {})
        self._absorb_optimizer_state()
        # Note [Mixed precision]: host buffers are shaped, the device copies change dtype (Note [The model as it
        # enters]: a window an entry)
        self.masters.to_compute(settle)
        self.streamer = Streamer(entries, self.masters, self.bucket_bytes, self.stepper.wait, self.stepper.updated,
                                 fits, copies, backward_ended=self._backward_ended,
                                 before_repack=self.stepper.flush)  # fmt: skip
        self.weight_hooks = WeightHooks(self.streamer, entries)
        self.guard.watched = self.weight_hooks.watched
        for e in entries:
            self.masters.drop(e)
        self.started = True
        self.guard.__enter__()
        self._restore.append(lambda: self.guard.__exit__(None, None, None))
        self.weight_hooks.install(self.model)
        self._restore.append(self.weight_hooks.uninstall)
        self._restore.append(refuse_ddp_forward(self.model))  # Note [DDP that wraps the model later]
        self.grads.install()
        self._restore.append(self.grads.uninstall)
        handle = self.optimizer.register_step_pre_hook(self._step_pre_hook)
        self._restore.append(handle.remove)
        handle = self.optimizer.register_step_post_hook(self._step_post_hook)
        self._restore.append(handle.remove)
        self._restore.append(self._user_flags_back)
        for obj in (self.optimizer, self.model):
            self._wrap_zero_grad(obj)
        self._entry_index = {id(p): e.index for e in entries for _, p in e.params}
        self.state_dicts = StateDictHooks(self.model, self.optimizer, entries, self.flush, self._host_param,
                                          self.stepper.state_of, self.stepper.set_state, self._settle,
                                          self._off_device, self.busy, self._hand_out)  # fmt: skip
        self.state_dicts.install()
        self._restore.append(self.state_dicts.uninstall)
        clipping.route(self)
        self._restore.append(lambda: clipping.unroute(self))
        self.grads.compute_dtype = self.compute_dtype
        self._restore.append(scaling.route(self.optimizer, self.grads, self.device))  # Note [Unscaling host gradients]
        if self.compute_dtype is not None:
            self._restore.append(cast_forward_inputs(self.model, self.compute_dtype).remove)

    @property
    def pinned(self) -> bool:
        """Whether the host masters and gradient buffers are page-locked (CUDA runs, or a ``pinner`` given)."""
        return self.device.type == "cuda" or self.pinner is not None

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """The runtime's own operators: the guard lets them through, the operator profiler does not record them."""
        with self.guard.busy(), self._own_work():
            yield

    def _absorb_optimizer_state(self) -> None:
        """State the user's optimizer already has for managed parameters moves to the host step."""
        state = self.optimizer.state
        for e in self.entries:
            for _, p in e.params:
                if p in state:
                    like = self.host_of[id(p)]
                    self.stepper.set_state(p, {k: host_state_value(k, v, like) for k, v in state[p].items()})
                    del state[p]

    def _wrap_zero_grad(self, obj: Any) -> None:
        """``zero_grad`` of ``obj`` also resets the host gradients (Note [Gradients on the host])."""
        original = obj.zero_grad
        had_own = "zero_grad" in vars(obj)

        def zero_grad(set_to_none: bool = True, *args: Any, **kwargs: Any) -> None:
            with self.grads.raw():  # torch's attributes; the host buffers are reset below, without waiting
                original(set_to_none, *args, **kwargs)
            self.grads.zero(self.grads.params, set_to_none)
            self.stepper.policy.zeroed()

        obj.zero_grad = zero_grad

        def restore() -> None:
            if had_own:
                obj.zero_grad = original
            else:
                del obj.zero_grad

        self._restore.append(restore)

    # -- the guard's callbacks --------------------------------------------------------------------------
    def _dropped(self, entry: int) -> bool:
        return not self.masters.current[entry]

    def _demand(self, entry: int) -> None:
        self.streamer.demand(entry)

    def _landed(self, entry: int) -> None:
        """An operator reads ``entry``'s device copy: its copy in flight, if any, is waited for first (Note [Reads
        of weights in flight] in swap.runtime.model_state.guard)."""
        self.masters.ready(self.entries[entry])

    def _wrote(self, entry: int) -> None:
        self.masters.dirty[entry] = True
        self.stepper.invalidate(self.streamer.bucket_of[entry])  # its write-back would change the master

    def _host_param(self, p: torch.nn.Parameter) -> torch.Tensor:
        """``p``'s host master, for a state dict to give or load into: its compute copy is cast again at its next
        fetch (Note [One cast per master change] in storage)."""
        self.masters.changed(self.entries[self._entry_index[id(p)]])
        return self.host_of[id(p)]

    # Note [Masters handed out]
    # ``model.state_dict()`` gives an offloaded parameter's host master as torch gives a parameter: a tensor that
    # is the weight (``detach()``, sharing its memory and version counter), so a user who keeps the state dict and
    # writes into it (``sd[k].mul_(0.5)``, an EMA or a hand-made decay) writes the weight, as in plain torch. Such a
    # write comes at any time and no counter of ours sees it, and the master has host work of its own: a
    # speculative step made during the backward (Note [Speculative host steps]) would be kept over a write
    # between the backward and ``opt.step()``, or its rollback would undo the write; a host step still running
    # after ``opt.step()`` returned would race a write (or a read) right after it. So while any tensor a state
    # dict handed out for an entry is alive (weak references, per entry: buckets re-pack), the entry's bucket is
    # not speculated, and ``opt.step()`` returns only once its host step is done. A state dict saved and let go
    # (``torch.save(model.state_dict(), f)``) costs nothing after it is gone.
    def _hand_out(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The tensor ``model.state_dict()`` gives for offloaded ``p``: its host master's ``detach()``, noted as
        handed out (Note [Masters handed out])."""
        hp = self._host_param(p)
        with _disable_current_modes():  # host memory: no meter's business
            view = hp.detach()
        self._handed_out.setdefault(self._entry_index[id(p)], []).append(weakref.ref(view))
        return view

    def _exposed(self, b: int) -> bool:
        """Whether a tensor a state dict handed out for one of bucket ``b``'s masters is still alive."""
        for i in self.streamer.buckets[b]:
            refs = self._handed_out.get(i)
            if refs is None:
                continue
            refs[:] = [r for r in refs if r() is not None]
            if refs:
                return True
            del self._handed_out[i]
        return False

    def _off_device(self, p: torch.nn.Parameter) -> bool:
        """Whether ``p``'s host master is the truth (every placement but resident), frozen parameters included:
        a state dict takes their value from the host (Note [Saving without fetching])."""
        return self.masters.placement[self._entry_index[id(p)]] != Placement.RESIDENT

    def _settle(self, entries: list[int]) -> None:
        """Written device copies of ``entries`` go back to their masters, and the weights off the device (their
        whole buckets: a demand fetch brought each bucket whole)."""
        s = self.streamer
        with s.lock:
            for b in dict.fromkeys(s.bucket_of[i] for i in entries):
                s.drop_bucket(b)

    # -- speculation (Note [Speculative host steps] in speculation) ---------------------------------------------
    def _needed_of(self, b: int) -> list[torch.nn.Parameter]:
        """Bucket ``b``'s parameters whose gradients make it final (trainable ones the optimizer steps)."""
        s = self.streamer
        packing, needed = self._needed
        if packing is not s.buckets:
            stepped = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
            needed = {k: [p for i in members for _, p in self.entries[i].params if trains(p) and id(p) in stepped]
                      for k, members in enumerate(s.buckets)}  # fmt: skip
            self._needed = (s.buckets, needed)
        return needed[b]

    def _members_of(self, b: int) -> int:
        return sum(len(self.entries[i].params) for i in self.streamer.buckets[b])

    def _may_speculate(self) -> bool:
        s = self.streamer
        # Not before buckets are packed by use (the first backward re-packs them: Note [Entries and buckets]).
        packed = s.packed_by_use or any(p != Placement.STREAMED for p in s.placements)
        return packed and self.stepper.policy.now()

    def _speculate(self, b: int) -> None:
        self._specced.add(b)
        if self._handed_out and self._exposed(b):  # Note [Masters handed out]
            return
        self.stepper.speculate(b, [p for i in self.streamer.buckets[b] for _, p in self.entries[i].params])

    def _grad_arrived(self, p: torch.nn.Parameter) -> None:
        """A gradient is on its way to the host: its bucket speculates once all of its gradients are."""
        if not self.speculate:
            return
        s = self.streamer
        b = s.bucket_of[self._entry_index[id(p)]]
        self._arrived.add(id(p))
        if b in self._specced or s.placements[b] == Placement.RESIDENT or not self._may_speculate():
            return
        needed = self._needed_of(b)
        # A bucket that also holds weights without a gradient (frozen, or not the optimizer's: a LoRA base) is
        # read again later in this backward (its input's gradient): it speculates at the backward's end instead,
        # or that read would roll it back.
        if len(needed) == self._members_of(b) and all(id(q) in self._arrived for q in needed):
            self._speculate(b)

    def _backward_ended(self) -> None:
        """Every gradient landed; buckets some of whose parameters got none speculate now."""
        self.grads.settle()
        try:
            if self.speculate and self._arrived and self._may_speculate():
                s = self.streamer
                for b, placement in enumerate(s.placements):
                    if placement != Placement.RESIDENT and b not in self._specced and \
                            any(id(q) in self._arrived for q in self._needed_of(b)):  # fmt: skip
                        self._speculate(b)
        finally:
            self._arrived, self._specced = set(), set()
            self.stepper.policy.backward_ended()

    # -- the optimizer step -----------------------------------------------------------------------------
    def _step_pre_hook(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Note [Host step after confirmation]."""
        if any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:  # args[0] is the optimizer
            raise RuntimeError("opt.step(closure) re-evaluates the model inside the step, and the SwapManager steps "
                               "offloaded parameters on the host after their gradients are final: call the closure "
                               "yourself (loss = closure()), then opt.step()")  # fmt: skip
        s = self.streamer
        s.drop_all(stale=True)
        if self._proposed is None and self.plan is None and self.decide is not None:
            self._proposed = self.decide(specs(self.entries, s.buckets, self.optimizer))
        if self._proposed is not None:
            self._apply(self._proposed)
        offloaded = [b for b, p in enumerate(s.placements) if p != Placement.RESIDENT]
        self.grads.settle()
        self.stepper.queue({b: [p for i in s.buckets[b] for _, p in self.entries[i].params] for b in offloaded})
        self.stepper.policy.stepped()
        self._record()
        self.grads.stepping = True  # the user's optimizer skips offloaded parameters (Note [p.grad of an ...])
        if self.device.type == "cpu" and len(offloaded) < len(s.placements):
            self._one_kernel_on_cpu()

    def _step_post_hook(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.grads.stepping = False
        self._user_flags_back()
        if self._handed_out:  # Note [Masters handed out]
            for b in range(len(self.streamer.buckets)):
                if self._exposed(b):
                    self.stepper.wait(b)

    # Note [One kernel on a CPU run]
    # The host step runs torch's fused kernel where the user left the default (Note [The host kernel]); resident
    # buckets are stepped by the user's optimizer. On a CUDA run those are another device's kernels anyway, but on
    # a CPU run both are CPU kernels of one training, and two of them (fused for offloaded buckets, the per-tensor
    # loop for resident ones) would make a run that equals plain training with neither. So there, for the length
    # of the user's step only, its groups carry the host's kernel flags: the whole run is then bitwise plain
    # training with ``fused=True``, the reference Note [The host kernel] names. The user's flags are back before
    # ``opt.step()`` returns, so state dicts, schedulers and the user's code never see the change.
    def _one_kernel_on_cpu(self) -> None:
        self._user_flags_back()  # a step that raised never ran the post-hook
        overrides = self.stepper.kernel.overrides
        if not overrides:
            return
        groups = self.optimizer.param_groups
        self._user_flags = [{k: g.get(k) for k in overrides} for g in groups]
        for g in groups:
            g.update(overrides)

    def _user_flags_back(self) -> None:
        saved, self._user_flags = self._user_flags, None
        for g, flags in zip(self.optimizer.param_groups, saved or ()):
            g.update(flags)

    def propose(self, plan: ModelStatePlan) -> None:
        """Places the buckets as ``plan`` says from the next ``opt.step()`` on (Note [Changing placements])."""
        if len(plan.placements) != len(self.streamer.buckets):
            raise ValueError(f"the plan places {len(plan.placements)} buckets, the model has "
                             f"{len(self.streamer.buckets)}")  # fmt: skip
        self._proposed = plan

    # Note [Changing placements]
    # Every bucket starts streamed (the conservative plan: it holds the least of the device). A plan made later
    # is applied at an ``opt.step()``, before the host steps are queued and before the user's optimizer runs:
    # the gradients are final and on the host then, and the weights off the device. A bucket made resident
    # waits for its pending host update, fetches its weights for good, and hands its host gradients and
    # optimizer state to the user's optimizer on the device (copied there, cast as torch's load casts them), so
    # this very step is a device step; a bucket made a host master keeps its compute copy from its next use on.
    # Placements only move towards the device (a plan is made once, from the profiled iterations).
    def _apply(self, plan: ModelStatePlan) -> None:
        s = self.streamer
        self._proposed = None
        if self.compute_dtype is not None and Placement.RESIDENT in plan.placements:  # Note [Mixed precision]
            note = (f"{plan.placements.count(Placement.RESIDENT)} bucket(s) the plan made resident are host masters: "
                    "under compute_dtype the host steps the fp32 masters")  # fmt: skip
            placements = [Placement.HOST_MASTER if p == Placement.RESIDENT else p for p in plan.placements]
            sites = [UpdateSite.HOST] * len(placements)
            plan = replace(plan, placements=placements, update_sites=sites, notes=[*plan.notes, note])
        for b, placement in enumerate(plan.placements):
            old = s.placements[b]
            if placement == old or old == Placement.RESIDENT:
                continue
            self.stepper.wait(b)
            for i in s.buckets[b]:
                e = self.entries[i]
                if placement == Placement.RESIDENT:
                    self._make_resident(e)
                else:
                    self.masters.placement[i] = placement
            s.placements[b] = placement
        self.plan = plan

    def _make_resident(self, e: Any) -> None:
        self.masters.make_resident(e)
        self.weight_hooks.watched.pop(e.key, None)
        state = self.optimizer.state
        groups = self.optimizer.param_groups
        group_of = {id(p): g for g in groups for p in g["params"]}
        for _, p in e.params:
            self.copies.state_in += self.grads.to_device(p, self.device)
            moved = {k: device_state_value(k, v, p, group_of[id(p)]) for k, v in self.stepper.take_state(p).items()}
            if moved:
                state[p] = moved
                self.copies.state_in += sum(v.numel() * v.element_size() for v in moved.values()
                                            if isinstance(v, torch.Tensor))  # fmt: skip

    def _totals(self, activations: Callable[[], tuple[int, int]]) -> dict[str, Any]:
        c = self.copies
        a_in, a_out = activations()
        return {"weights_in_bytes": c.weights_in, "weights_out_bytes": c.weights_out, "grads_out_bytes": c.grads_out,
                "state_in_bytes": c.state_in,
                "activations_in_bytes": a_in, "activations_out_bytes": a_out, "stall_seconds": c.stall_seconds,
                "demand_fetches": c.demand_fetches}  # fmt: skip

    def _record(self) -> None:
        """The bytes moved since the last optimizer step (the report's per-step rows)."""
        now = self._totals(self.activation_bytes)
        row = {k: now[k] - self._last[k] for k in now}
        row.update(step=self.stepper.steps, state_out_bytes=0)
        self._last = now
        self.records.append(row)

    def _step_row(self, record: dict[str, Any]) -> dict[str, Any]:
        """A per-step row with its host step's seconds, the part something waited for (exposed) and the rest
        (hidden behind other work); ``exposed_stall_seconds``: those waits plus waits for weights to land."""
        k = record["step"]
        seconds = self.stepper.seconds.get(k, 0.0)
        exposed = self.stepper.exposed.get(k, 0.0)
        return {**record, "host_step_seconds": seconds, "host_step_exposed_seconds": exposed,
                "host_step_hidden_seconds": max(0.0, seconds - exposed),
                "exposed_stall_seconds": record["stall_seconds"] + exposed}  # fmt: skip

    def flush(self) -> None:
        """Every pending host step done, every written device copy back on the host."""
        self.stepper.flush()
        with self.streamer.lock:
            self.masters.write_back_dirty()

    # -- clipping -------------------------------------------------------------------------------------------
    def manages(self, p: torch.Tensor) -> bool:
        return self.started and self.grads.manages(p)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:  # fmt: skip
        """Note [Exact clipping]."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        self.grads.settle()
        grads, host = [], []
        for p in params:
            managed = self.grads.manages(p)
            g = self.grads.grad(p) if managed else p.grad
            if g is not None:
                grads.append(g)
                host.append(managed)
        with torch.no_grad():
            total = clipping.total_norm(grads, norm_type, error_if_nonfinite, foreach, self.device, host)
            managed, others = clipping.managed_split(params, self.grads.manages)
            torch.nn.utils.clip_grads_with_norm_(others, max_norm, total, foreach)
            if clipping.scale_host([g for p in managed if (g := self.grads.grad(p)) is not None], max_norm, total,
                                   foreach):  # fmt: skip
                self.grads.touch(managed)
        return total

    # -- closing ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Pending work done; weights, gradients and optimizer state back where plain torch keeps them (the model
        runs without the manager after this); hooks removed; host memory returned."""
        if not self.started:
            return
        try:
            self.flush()
            self.final = self.snapshot()
            self.grads.settle()
            saved = self.optimizer.state_dict()  # with the host state (Note [State dicts of offloaded model state])
            for e in self.entries:
                if self.masters.mixed(e):
                    self.masters.to_master(e)  # Note [Mixed precision]: the parameters are the fp32 masters again
                else:
                    self.masters.make_resident(e)
            self.streamer.held.clear()
            with torch.no_grad():
                for p in self.grads.params:
                    g = self.grads.grad(p)
                    if g is not None:
                        set_raw_grad(p, g.to(self.device, copy=True))
        finally:
            for undo in reversed(self._restore):
                undo()
            self._restore = []
            self.started = False
        self.optimizer.load_state_dict(saved)
        self.worker.shutdown(wait=True)
        self.lane.shutdown(wait=True)
        # Note [Host memory outlives its copies]
        # The weights' copies back to the device were ordered before the compute that reads them, on the device
        # only: the host went on. The host masters are unpinned and freed below, so the host waits for every
        # copy first; one still queued must not read pages already unpinned or freed.
        self.masters.engine.drain()
        self.grads.close()
        self.masters.close()
        for pool in self.pools:
            pool.close()
        # The report keeps ``final``; nothing here may keep the model, its state or host memory alive.
        self.model = self.optimizer = self.decide = None
        # Note [A closed runtime holds nothing]
        # The manager keeps its runtime after exit (``sm.model_state``, the report), and users keep the manager:
        # every part that reaches a parameter or a host buffer goes here. The weight hooks reach the streamer, so
        # the masters and the host step's state; the speculation's cache of each bucket's parameters reaches the
        # parameters, so their gradients. Kept, they held the whole trained model alive (21 MB for the 2.6 MB MLP
        # of test_ms_defaults), which the next run's CPU budget counts (Note [What the CPU budget counts] in
        # swap.runtime.machine.memory): a retry at the smallest budget a refusal named was refused again.
        self.entries, self.pools, self.host_of, self.records = [], [], {}, []
        self._needed, self._arrived, self._specced, self._entry_index = (None, {}), set(), set(), {}
        self._handed_out = {}
        for part in ("masters", "grads", "stepper", "streamer", "state_dicts", "guard", "worker", "lane",
                     "weight_hooks"):
            delattr(self, part)

    # -- the report -------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The report's ``model_state`` fields (after ``close``: as they were at its start)."""
        if self.final is not None:
            return dict(self.final)
        pred = self.prediction
        data: dict[str, Any] = {
            "mode": self.mode,
            "precision": self.precision,  # Note [Mixed precision]
            "host_bytes_predicted": pred.total,
            "pinned_bytes_predicted": pred.pinned if self.pinned else 0,
            "state_bytes_predicted": pred.state,
            "bucket_bytes": self.bucket_bytes,
        }
        if self.choice is not None:
            data["choice"] = dict(self.choice)
        if not self.started:
            return data
        stepper = self.stepper
        state_bytes = sum(v.untyped_storage().nbytes() for st in list(stepper.shadow.state.values())
                          for v in st.values() if isinstance(v, torch.Tensor))  # fmt: skip
        buckets = specs(self.entries, self.streamer.buckets, self.optimizer)
        return {
            **data,
            "placements": {p.value: n for p in Placement if (n := self.streamer.placements.count(p))},
            "buckets": len(buckets),
            "bucket_specs": [asdict(b) for b in buckets],  # swap.schedule.model_state.Bucket, for a planner
            "host_step_seconds": sum(stepper.seconds.values()),
            "host_step_exposed_seconds": sum(stepper.exposed.values()),
            "host_bytes": sum(p.reserved for p in self.pools) + state_bytes,
            "pinned_bytes": sum(p.pinned_bytes for p in self.pools),
            "state_bytes": state_bytes,
            "steps": [self._step_row(r) for r in self.records],
            "host_kernel": stepper.kernel.name,  # Note [The host kernel]
            # Note [Speculative host steps]: how many, how many kept, the seconds rolled back, the copies' bytes
            "speculation": {**stepper.counts, "on": self.speculate, "wasted_seconds": stepper.wasted_seconds,
                            "rollback_bytes_predicted": pred.rollback,
                            "rollback_bytes_peak": stepper.rollback_bytes_peak},  # fmt: skip
            "host_threads": self.host_threads,
            "notes": list(stepper.notes),
            **self._totals(self.activation_bytes),
        }
