"""The operator profiler: in profiling iterations, what each forward operator costs and makes, and where
candidate modules start and end, as the planner's operator table (swap.joint.ops, Note [Operator table]).

Note [Operator profiler]
A TorchDispatchMode sees every operator below autograd. While active it records, per forward operator: its
name, the innermost module (``ModulePaths``, read from the stack), its seconds, FLOPs (torch.utils.flop_counter's
registry) and bytes moved, its output and input storages (numbered; a storage the executor saves becomes
that variable), what it writes in place, and whether it can be rerun (swap.runtime.auto.op_facts). Forward
pre- and post-hooks on the candidate modules (children of containers, Note [Candidate regions]) record each
call's span and the tensors a checkpoint of it would save.

- Seconds: on CPU, the operator's own host time, measured. On CUDA a host clock measures the launch, not
  the kernel, and CUDA events per operator would serialise the launch queue they measure; so each operator
  is priced on the roofline of the device's datasheet profile (``swap.devices.cuda_profile``), on the peak of
  its precision and kind (bf16 on tensor cores; fp32 convolutions and matmuls on TF32 tensor cores where
  PyTorch's flags let them, read when profiling starts: Note [Peaks by precision and kind] in
  swap/devices.py), and the forward's total is scaled to the forward time the step timers measured with
  CUDA events (``calibrate``): relative costs from the roofline, the absolute scale from the device.
- The mode is entered with the manager and left when profiling ends (never pushed in the middle of an
  iteration, where a user's own mode could be popped in its place); inactive, it passes operators through.
- Iterations: an iteration's first saved tensor comes after its first operators (the op that makes it
  runs first). Operators after a backward pass are held back; when the next iteration starts, the trailing
  ones that ran inside a module belong to it (its forward's head), the rest (the optimizer step) are dropped.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import SAC_IGNORED_OPS

from ...devices import DeviceProfile, cuda_profile, operator_kind, with_tf32
from ...joint.ops import Op, OpTable, RegionCall, is_index
from ..activations.executor import Executor
from ..activations.hooks import SavedTensorHooks
from ..activations.tracer import ModulePaths
from .op_facts import (
    aliases_output,
    blocker,
    draws_default_rng,
    element_flops,
    sharded_inside,
    stateful_argument,
    tensors_of,
    written_args,  # fmt: skip
)
from .regions import innermost_hooks_are


@dataclass
class _Raw:
    name: str
    module: str
    seconds: float
    flops: float
    nbytes: float
    outs: tuple[int, ...]
    out_sizes: tuple[int, ...]
    ins: tuple[int, ...]
    writes: tuple[int, ...]
    keepable: bool
    blocker: str
    rng: bool
    step: int
    hooked: bool
    in_module: bool
    after_backward: bool
    compiled: bool = False
    unkeepable: bool = False  # cannot be rerun, nor kept (Note [Operators that cannot be rerun])


@dataclass
class _RawCall:
    path: str
    first: int
    step: int
    inputs: list[tuple[int, int]]
    blocker: str
    end: int = -1
    end_step: int = -1


class OpProfiler(TorchDispatchMode):
    """Records operator tables while ``active`` (Note [Operator profiler]). ``executor`` says the step and
    whether a backward pass runs; ``hooks``, the manager's saved-tensor hooks, say which tensors the executor
    takes, tell a user's own checkpoint apart, and whether the manager is inside them (what runs there is
    not the model's). ``roofline``: the profile that prices operators instead of timing them (default on
    CUDA: the device's, with PyTorch's TF32 flags as they are now; None on CPU: timed)."""

    def __init__(self, executor: Executor, hooks: SavedTensorHooks, device: torch.device,
                 roofline: Optional[DeviceProfile] = None) -> None:  # fmt: skip
        super().__init__()
        self.ex = executor
        self.hooks = hooks
        self.device = device
        self.active = True
        self.paths = ModulePaths()
        self.table: Optional[OpTable] = None  # the last finished iteration's
        self.modules: dict[str, torch.nn.Module] = {}  # candidate path -> module (weakly: see _hook)
        self._sharded: dict[str, str] = {}  # candidate path -> why FSDP2 sharding inside it blocks it ("" if not)
        self.roots: list[weakref.ref] = []
        self._sids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._next_sid = 0
        self._var: dict[int, int] = {}  # storage id -> variable, this iteration
        self._log: list[_Raw] = []
        self._calls: list[_RawCall] = []
        self._open: list[_RawCall] = []
        self._handles: dict[str, list[Any]] = {}  # candidate path -> its pre- and post-hook handles
        if roofline is None and device.type == "cuda":
            roofline = with_tf32(cuda_profile(torch.cuda.get_device_name(device)), "auto")
        self.roofline = roofline

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # Note [Meter and torch.compile] in swap.runtime.machine.meter: compiled code must stay compiled

    # -- storages ---------------------------------------------------------------------------------------
    def _sid(self, t: torch.Tensor) -> int:
        st = t.untyped_storage()
        sid = self._sids.get(st)
        if sid is None:
            sid = self._next_sid
            self._next_sid += 1
            self._sids[st] = sid
        return sid

    def saved(self, t: torch.Tensor, var: int) -> None:
        """The executor made ``t``'s storage variable ``var`` of this iteration."""
        if self.active:
            self._var.setdefault(self._sid(t), var)

    def _managed(self, value: Any) -> tuple[list[int], list[int]]:
        sids, sizes = [], []
        for t in tensors_of(value):
            if self.hooks.manages(t):
                sid = self._sid(t)
                if sid not in sids:
                    sids.append(sid)
                    sizes.append(t.untyped_storage().nbytes())
        return sids, sizes

    # -- operators --------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        ex = self.ex
        if not self.active or func in SAC_IGNORED_OPS or ex.in_backward or self.hooks.busy:
            return func(*args, **kwargs)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        t1 = time.perf_counter()
        seconds = t1 - t0
        module = self.paths.current()
        root = self.paths.root
        if root is not None and not any(r() is root for r in self.roots):
            self._add_root(root)
        outs, out_sizes = self._managed(out)
        ins, _ = self._managed((args, list(kwargs.values())))
        writes = tuple(self._sid(t) for t in written_args(func, args, kwargs))
        flops = element_flops(func, args, kwargs, out) or 0.0
        touched = tensors_of((args, list(kwargs.values()), out))
        nbytes = float(sum(t.numel() * t.element_size() for t in touched))
        if self.roofline is not None:
            # the operator's precision: its first float tensor's
            first_float = next((t.dtype for t in touched if t.is_floating_point()), None)
            low = first_float in (torch.bfloat16, torch.float16)
            seconds = self.roofline.step_seconds(flops, nbytes, low, operator_kind(str(func)))
        why = blocker(func, args, kwargs, self.device)
        rng = draws_default_rng(func, args, kwargs)
        aliasing = aliases_output(func)
        keepable = not aliasing and not writes and not rng and bool(outs)
        # Note [Operators that cannot be rerun]: one that also writes in place or draws from the default
        # generator cannot be kept either; its module is not checkpointed.
        unkeepable = bool(why) and (aliasing or bool(writes) or rng)
        self._log.append(_Raw(
            str(func), module, seconds, flops, nbytes, tuple(outs), tuple(out_sizes), tuple(ins), writes, keepable,
            why, rng, ex.step, innermost_hooks_are(self.hooks.pair), self.paths.in_module, ex.backward_done,
            self.paths.compiled, unkeepable,
        ))  # fmt: skip
        # Note [Our own time is not the model's] (swap.runtime.machine.timers)
        ex.timer.exclude(time.perf_counter() - t1)
        return out

    # -- candidate modules ------------------------------------------------------------------------------
    def _add_root(self, root: torch.nn.Module) -> None:
        self.roots.append(weakref.ref(root))
        prefix = "" if len(self.roots) == 1 else f"{len(self.roots) - 1}:"
        for name, m in root.named_modules():
            if name and is_index(name.rsplit(".", 1)[-1]) and prefix + name not in self.modules:
                path = prefix + name
                self.modules[path] = m
                self._sharded[path] = sharded_inside(m)
                # Note [Hooks and torch.compile] (swap.runtime.activations.signals): dynamo must run the hooks,
                # not trace them.
                pre, post = torch._dynamo.disable(self._pre(path)), torch._dynamo.disable(self._post(path))
                self._handles[path] = [m.register_forward_pre_hook(pre, with_kwargs=True),
                                       m.register_forward_hook(post, always_call=True)]  # fmt: skip

    # Note [Hooks removed only outside their dispatch]
    # torch's ``Module._call_impl`` iterates a snapshot of a module's hooks but looks up "with_kwargs" in the live
    # dict for each one. Profiling can end inside a module's pre-hooks (model state: the streamer's pre-hook begins
    # the iteration that judges the last profiled one), and removing the profiler's hooks there made torch call
    # the rest of the snapshot without ``kwargs``. So ``stop`` never touches a hook dict: it disables the hooks
    # (``active``), and each one removes its module's pair the next time it runs, from inside its own call, where
    # its own lookup is already done; those of modules that never run again go with ``forget_modules`` (the
    # manager's exit, outside any forward).
    def _retire(self, path: str) -> None:
        for h in self._handles.pop(path, ()):
            h.remove()

    def _pre(self, path: str) -> Callable:
        def pre(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if not self.active:
                self._retire(path)  # Note [Hooks removed only outside their dispatch]
                return
            if self.ex.in_backward:
                return
            leaves, _ = tree_flatten((args, kwargs))
            inputs = [(self._sid(t), t.untyped_storage().nbytes()) for t in leaves
                      if isinstance(t, torch.Tensor) and self.hooks.manages(t)]  # fmt: skip
            why = stateful_argument(leaves) or self._sharded.get(path, "")
            if not why and not torch.is_grad_enabled():
                why = "it ran with gradients off"
            elif not why and not innermost_hooks_are(self.hooks.pair):
                why = "it runs inside saved-tensor hooks of your own (your torch.utils.checkpoint, or save_on_cpu)"
            call = _RawCall(path, len(self._log), self.ex.step, inputs, why)
            self._open.append(call)
            self._calls.append(call)

        return pre

    def _post(self, path: str) -> Callable:
        def post(module: torch.nn.Module, args: tuple, kwargs: Any, *rest: Any) -> None:
            if not self.active:
                self._retire(path)
                return
            if not self._open or self._open[-1].path != path:
                return
            call = self._open.pop()
            call.end, call.end_step = len(self._log), self.ex.step

        return post

    # -- iterations -------------------------------------------------------------------------------------
    def iteration_starts(self) -> None:
        """The executor is about to start an iteration: the one before it ends here (Note [Operator profiler])."""
        if not self.active:
            return
        log = self._log
        cut = len(log)
        while cut > 0 and log[cut - 1].after_backward and log[cut - 1].in_module:
            cut -= 1
        tail_from = cut
        while tail_from > 0 and log[tail_from - 1].after_backward:
            tail_from -= 1
        finished = [c for c in self._calls if 0 <= c.end <= tail_from]
        if any(not r.after_backward for r in log[:tail_from]):
            self.table = self._finish(log[:tail_from], finished)
        carried = [replace(r, step=0, after_backward=False) for r in log[cut:]]
        self._log = carried
        self._calls = [replace(c, first=c.first - cut, step=0) for c in self._calls if c.first >= cut]
        self._open = [c for c in self._calls if c.end < 0]
        self._var = {}

    def _finish(self, log: list[_Raw], calls: list[_RawCall]) -> OpTable:
        def number(sid: int) -> int:
            return self._var.get(sid, -1 - sid)

        written_after: dict[int, int] = {}  # storage -> last operator index that wrote it
        for j, r in enumerate(log):
            for sid in r.writes:
                written_after[sid] = j
        ops = []
        for j, r in enumerate(log):
            keepable = r.keepable and all(written_after.get(s, -1) < j for s in r.outs)
            ops.append(Op(r.name, r.module, r.seconds, r.flops, r.nbytes, sum(r.out_sizes), r.step,
                          tuple(number(s) for s in r.outs), r.out_sizes, tuple(number(s) for s in r.ins), keepable,
                          r.blocker, r.rng))  # fmt: skip
        table_calls = []
        for c in calls:
            why = c.blocker
            inputs = {sid for sid, _ in c.inputs}
            for r in log[c.first : c.end]:
                if not why and r.compiled:
                    why = "it runs inside torch.compile (a checkpoint cannot wrap a compiled region's forward)"
                if not why and not r.hooked:
                    why = "it runs a torch.utils.checkpoint (or other saved-tensor hooks) of your own inside"
                if not why and r.unkeepable:
                    why = (f"{r.name} cannot be rerun ({r.blocker}), nor kept: it writes in place or draws from the "
                           "default generator")  # fmt: skip
                hit = next((s for s in r.writes if s in inputs), None)
                if not why and hit is not None:
                    why = f"{r.name} writes one of its inputs in place (autograd would reject the saved input)"
            table_calls.append(RegionCall(c.path, (c.first, c.end), (c.step, max(c.step, c.end_step)),
                                          tuple((number(s), b) for s, b in c.inputs), why))  # fmt: skip
        return OpTable(ops, table_calls)

    def stop(self) -> None:
        """Profiling is over: record nothing more; the module hooks go as they next run (Note [Hooks removed only
        outside their dispatch])."""
        self.active = False
        self._log, self._calls, self._open = [], [], []

    def forget_modules(self) -> None:
        """Drops every reference to the model's modules and the hooks left on them (the paths stay, for the
        report). Call it outside any module's forward."""
        for path in list(self._handles):
            self._retire(path)
        self.modules = dict.fromkeys(self.modules)  # type: ignore[assignment]
        self.roots = []
        self.paths = ModulePaths()

    def module(self, path: str) -> Optional[torch.nn.Module]:
        return self.modules.get(path)

    @property
    def open_paths(self) -> set[str]:
        """The candidate modules whose forward has begun and not ended (an iteration may stop in one)."""
        return {c.path for c in self._open}


def remove_mode(mode: TorchDispatchMode) -> bool:
    """Takes ``mode`` off the dispatch-mode stack wherever it is, leaving the others in their order; False if
    it is not there."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    stack = _get_current_dispatch_mode_stack()
    if not any(m is mode for m in stack):
        return False
    if stack[-1] is mode:
        mode.__exit__(None, None, None)  # on top: the ordinary way, which also restores torch's mode flags
        return True
    above = []
    while True:
        m = _pop_mode()
        if m is mode:
            break
        above.append(m)
    for m in reversed(above):
        _push_mode(m)
    return True
