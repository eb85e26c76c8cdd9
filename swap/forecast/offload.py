"""The forecast with model state: activations planned by the joint search, model state placed by
``plan_model_state``, the iteration simulated with a host-step lane, side by side with the offloading
schedules of other systems on the same simulator.

Note [Offload schedules side by side]
Each schedule is a placement of every bucket, where the host steps run, and the format the system keeps the
model in, judged on the same capture, device, host, activation search and simulator (Note [Model-state
simulation] in swap/schedule/model_state/sim.py):

- ``ours``: what ``SwapManager(model=, optimizer=)`` runs, and only that (Note [What the runtime runs]):
  placements planned under the budget (``plan_model_state``: a resident prefix, host masters, streamed
  buckets; the device room and the resident share tried and simulated, the fastest kept), host steps
  speculative in the backward where the runtime would speculate, else after ``opt.step()``, each bucket's next
  use waiting for its own (``speculative`` or ``before_use``), every role in the model's dtype (or the runtime's
  mixed precision), the host step on the kernel the runtime runs for the user's optimizer (``host_kernel``); the
  swapped activations may take all the host memory model state and its rollback copies leave;
- ``zero_offload`` (DeepSpeed ZeRO-Offload, ZeRO-2 with ``offload_optimizer``): compute copies resident,
  master and Adam on the host, the host step after the backward; without the one-step delayed update, which
  changes the math;
- ``zero3_offload`` (ZeRO-3 with ``offload_param`` and ``offload_optimizer``): weights streamed, the host
  step after the backward;
- ``fsdp2_cpu_offload`` (FSDP2 ``CPUOffloadPolicy`` with bf16 parameters and fp32 reduction): everything
  streamed; the fp32 shard is copied in and cast on the device, gradients leave in fp32; the host step after
  the backward. Clipping needs a second (gloo) process group;
- ``torchao_cpu_offload`` (torchao ``CPUOffloadOptimizer``): the model's own parameters stay on the device (in
  the master's dtype, cast by autocast at each forward), each stepped on the host after the backward and
  copied back; no gradient clipping.

Each system's host step runs its own kernel (Note [Host profiles] in swap/devices.py): DeepSpeed's CPU-Adam is a
single-pass kernel ("fused"); FSDP2 and torchao step with the user's torch optimizer on CPU tensors, whose default
is the per-tensor loop ("for-loop").

What is not modelled: DeepSpeed's fixed prefetch sizes (every schedule gets our window), NUMA and thread
placement on the host, and pinned-memory rounding (our host pool is exact: Note [Exact-size pinned blocks]).
For every schedule the activations are planned by the same joint search (``activations``: a strategy of
swap.joint.search, default ``auto``) with the model state's device bytes reserved at every step.

Note [What the runtime runs]
A forecast prices only what the runtime does. Today ``SwapManager(model=, optimizer=)``:
- speculates by default (Note [When to speculate] in swap/runtime/model_state/speculation.py): where the rollback
  copies of every offloaded parameter fit the host memory beside the model state (``ledger.speculates`` on
  ``ledger.rollback_bytes``, the runtime's own function and bytes), every offloaded bucket's host step starts in
  the last backward before ``opt.step()``, as soon as its gradients are on the host, after copying its master and
  state (priced at the host's DRAM bandwidth, read and written: ``save_seconds``); ``ours`` is then simulated
  ``speculative`` and its host bytes count the copies (``choice.with_speculation``, Note [Speculation as the
  runtime decides it]). Where they do not fit it steps the host optimizer after ``opt.step()`` returns (Note
  [Host step after confirmation] in swap/runtime/model_state/host_step.py): ``before_use``. A speculation that
  fails (the clip binds, GradScaler finds an inf, another micro-batch follows) is rolled back and redone by the
  runtime; its cost is not priced (every speculation is assumed to hold);
- keeps the parameter itself as the host master, so every role is in the model's dtype: a bf16 model trains as
  pure-bf16 AdamW (bf16 master and moments: ``runtime_format``), and fp32 master and state mean an fp32 model,
  whose fp32 weights cross the link and are cast on the device by autocast at each fetch (``cast="device"``;
  autocast's bf16 copies saved for the backward are not captured: the fetch's cast stands for them);
- runs the user's optimizer class on the host with the kernel ``host_kernel`` names: torch's fused CPU kernel
  where the user left torch's default (``RUNTIME_DEFAULT_KERNEL``; Note [The host kernel] in
  swap/runtime/model_state/host_optim.py), the user's own kernel where the user chose one (``foreach=``,
  ``fused=False``) or asked for ``differentiable=True``;
- with ``compute_dtype`` (``ModelStatePolicy(compute_dtype=)``), trains an fp32 model in mixed precision: Note
  [Mixed precision pricing].

Note [Mixed precision pricing]
``swap.plan(model_state=ModelStatePolicy(compute_dtype=torch.bfloat16))`` prices what the runtime does in that
mode (Note [Mixed precision] in swap/runtime/model_state/precision.py), ours in ``mixed_format`` (``StateFormat``
and every ``Bucket`` ``mixed``), through the ledger and packer the runtime calls (swap/schedule/model_state/):

- the capture: the model at ``compute_dtype`` (the runtime casts the weights and the root's floating-point inputs,
  no autocast: the activations are those of the model in that dtype);
- buckets: packed by the compute copies' bytes (the runtime's ``Entry.nbytes``), the bucket size by default from
  them; no bucket resident (``plan_model_state``), and "resident" refused, as the runtime refuses it;
- device bytes: the compute copies of host-master buckets and of streamed ones in flight, gradients in the
  compute dtype until they leave;
- host bytes (``ledger.host_bytes_of``, ``predict_host``'s figures): fp32 masters, fp32 gradient buffers, fp32
  optimizer state, the pinned compute-dtype copy each master is cast into, and the accumulation buffer (a bucket
  of the compute copies' size, or the largest compute-dtype gradient: every gradient arrives through it); pinned:
  the copies and the accumulation buffer only;
- the link: compute-dtype weights in (cast on the host), compute-dtype gradients out;
- host work: the fp32 step reads the fp32 gradient, and each bucket's arriving gradient is upcast into its fp32
  buffer (``compute_dtype`` bytes read, fp32 written), counted with its host step's bytes (the runtime does it on
  its gradient lane during the backward: counted on the host-step lane it may only err slow);
- the cast into the compute copy: the runtime casts the master once per change of it (``Masters.fetch``, Note [One
  cast per master change]), at its first fetch after the host step, on the thread that runs the model, before the
  copy starts; priced as ``cast_seconds`` on the compute stream at a bucket's first fetch of the iteration
  (``cast_once``; fp32 read, compute dtype written, at the host step kernel's rate: the host profiles measure
  no cast, so that rate is an assumption), and, for a host master (refreshed by a fetch after its host step), in
  its host step's bytes (``copy``; a streamed bucket's host step counts it too: 2 bytes a parameter too many).
The baselines keep their own formats in ``compute_dtype`` with fp32 masters (``state_format``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Union

import torch

from ..capture import Trace, capture
from ..devices import KERNELS, DeviceProfile, HostProfile, host_step_bytes
from ..joint.search import BASELINES, Evaluator, Outcome, search
from ..schedule.budget import InfeasibleBudget
from ..schedule.model_state import (
    Bucket,
    ModelStatePlan,
    ModelStatePolicy,
    ModelStatePrices,
    Placement,
    placement_named,
)
from ..schedule.model_state.choice import (
    ROOM_SHARES,
    Placed,
    candidates,
    place,
    simulate_placed,
    with_bytes,
    with_speculation,
)
from ..schedule.model_state.ledger import rollback_bytes
from ..schedule.model_state.weights import BucketUses, reserve
from ..schedule.sequence import Sequence
from .from_trace import sequence_from_trace
from .model_state import Layout, StateFormat, access_events, layout_from_trace, stateless_optimizer
from .offload_report import OffloadForecast, OffloadResult
from .ops_from_trace import table_from_trace
from .pricing import event_seconds

HOST_SHARES = (1.0,)  # of the host memory model state leaves: the most swapped activations may take (ours; the
# rollback copies of speculative host steps are in the model state's host bytes, Note [What the runtime runs])
RUNTIME_DEFAULT_KERNEL = "fused"  # where the user left torch's default (Note [What the runtime runs])
AUTO_EVALUATIONS = 60  # plans the joint search judges per activation plan
ROOM_GRID = 64  # rooms are rounded up to a 64th of the budget, so schedules share activation plans


@dataclass(frozen=True)
class OffloadSchedule:
    """One system's way of placing and stepping model state (Note [Offload schedules side by side])."""

    name: str
    label: str
    placement: Optional[Placement]  # None: planned
    timing: str  # ours: where the runtime does not speculate (it does where its copies fit: ``_ours``)
    clipping: str
    weight_in_master_dtype: bool = False  # the device keeps the model's parameters in the master's dtype
    cast: Optional[str] = None  # where the master is cast (None: the format's)
    grad_in_master_dtype: bool = False  # gradients leave the device in the master's dtype
    kernel: Optional[str] = None  # its host optimizer kernel (swap.devices.KERNELS; None: the runtime's, ours)
    model_dtype: str = ""  # ours: "model" (the user's model's dtype), "weight" (a model in the compute dtype) or
    # "mixed" (an fp32 model with ``ModelStatePolicy(compute_dtype=)`` the weights' dtype)

    def format(self, fmt: StateFormat, model_bytes: Optional[int] = None) -> StateFormat:
        """``fmt`` (the math: master and state dtypes, the compute dtype) as this system keeps it; ours for a
        model whose parameters take ``model_bytes`` an element (None: the master's, an fp32 model with autocast)."""
        if self.model_dtype == "model" and fmt.mixed:
            return fmt  # the runtime's mixed precision, as the user asked for it (Note [What the runtime runs])
        if self.model_dtype == "mixed":  # an fp32 model, compute_dtype fmt.weight (Note [Mixed precision pricing])
            return replace(fmt, cast="host", mixed=True)
        if self.model_dtype:
            return runtime_format(fmt, (model_bytes or fmt.master) if self.model_dtype == "model" else fmt.weight)
        weight = fmt.master if self.weight_in_master_dtype else fmt.weight
        grad = fmt.master if self.grad_in_master_dtype else fmt.grad
        return replace(fmt, weight=weight, grad=grad, cast=self.cast or fmt.cast, mixed=False)


def runtime_format(fmt: StateFormat, param_bytes: int) -> StateFormat:
    """What ``SwapManager(model=, optimizer=)`` keeps for a model whose parameters take ``param_bytes`` an element
    (Note [What the runtime runs]): every role in that dtype; cast on the device (autocast) where the compute
    dtype (``fmt.weight``) is narrower."""
    cast = "device" if fmt.weight < param_bytes else "host"
    return replace(fmt, weight=param_bytes, master=param_bytes, grad=param_bytes, state=param_bytes, cast=cast,
                   mixed=False)


SCHEDULES = {
    s.name: s
    for s in (
        OffloadSchedule("ours", "ours (the runtime)", None, "before_use", "exact (per-bucket partial norms)",
                        model_dtype="model"),
        OffloadSchedule("zero_offload", "ZeRO-Offload", Placement.HOST_MASTER, "blocking", "exact", kernel="fused"),
        OffloadSchedule("zero3_offload", "ZeRO-3-offload", Placement.STREAMED, "blocking", "exact", kernel="fused"),
        OffloadSchedule("fsdp2_cpu_offload", "FSDP2 CPUOffloadPolicy", Placement.STREAMED, "blocking",
                        "needs a gloo process group", cast="device", grad_in_master_dtype=True, kernel="for-loop"),
        OffloadSchedule("torchao_cpu_offload", "torchao CPUOffloadOptimizer", Placement.HOST_MASTER, "blocking",
                        "not supported", weight_in_master_dtype=True, cast="device", grad_in_master_dtype=True,
                        kernel="for-loop"),
        # ours in other settings the runtime runs, for side-by-side tables (bench.model_state_sim): the user's
        # AdamW made with foreach=False (the host step then runs torch's per-tensor loop), a model kept in the
        # compute dtype (pure bf16: not the baselines' math), and an fp32 model trained in the runtime's mixed
        # precision (the baselines' math: fp32 masters and state on the host, bf16 copies streamed)
        OffloadSchedule("ours_loop", "ours, AdamW(foreach=False)", None, "before_use",
                        "exact (per-bucket partial norms)", kernel="for-loop", model_dtype="model"),
        OffloadSchedule("ours_pure", "ours, model in bf16 (pure)", None, "before_use",
                        "exact (per-bucket partial norms)", model_dtype="weight"),
        OffloadSchedule("ours_mixed", "ours, compute_dtype=bf16", None, "before_use",
                        "exact (per-bucket partial norms)", model_dtype="mixed"),
    )
}  # fmt: skip
DEFAULT_SCHEDULES = ("ours", "zero_offload", "zero3_offload", "fsdp2_cpu_offload", "torchao_cpu_offload")


def prices_for(buckets: Seq[Bucket], fmt: StateFormat, dev: DeviceProfile, host: HostProfile,
               kernel: str = "fused") -> ModelStatePrices:  # fmt: skip
    """Per-bucket prices (Note [Model-state simulation]): host steps from the host profile at ``kernel``'s rate
    (the compute copy written by the host step when the host casts), a speculative step's rollback copy at the
    host's DRAM bandwidth, device steps and casts on the device's memory bandwidth."""
    copy = fmt.weight if fmt.cast == "host" and fmt.weight != fmt.master else 0
    dev_bw = dev.mem_bandwidth * dev.efficiency
    if fmt.mixed:  # Note [Mixed precision pricing]: the fp32 step reads the fp32 gradient, after its upcast
        host_bytes = [host_step_bytes(fmt.optimizer, b.numel, fmt.master, fmt.master, copy)
                      + b.numel * (fmt.grad + fmt.master) for b in buckets]  # fmt: skip
    else:
        host_bytes = [host_step_bytes(fmt.optimizer, b.numel, fmt.master, fmt.grad, copy) for b in buckets]
    rate = host.optimizer_rate(fmt.optimizer, kernel)
    own = fmt.weight if fmt.weight != fmt.master else 0  # the device step writes the compute copy too
    device_step = [host_step_bytes(fmt.optimizer, b.numel, fmt.master, fmt.grad, own) / dev_bw for b in buckets]
    cast = [b.numel * (fmt.master + fmt.weight) / dev_bw for b in buckets] if fmt.cast == "device" else []
    if fmt.mixed:  # Note [Mixed precision pricing]: the master cast once per change, on the thread running the model
        cast = [b.numel * (fmt.master + fmt.weight) / rate for b in buckets]
    # a speculative host step's rollback copy (Note [What the runtime runs]): master and state read and written once
    save = [2.0 * rollback_bytes([(b.master_bytes, b.state_bytes)]) for b in buckets]
    return ModelStatePrices(
        host.h2d_bandwidth or dev.h2d_bandwidth, host.d2h_bandwidth or dev.d2h_bandwidth,
        tuple(x / rate for x in host_bytes), tuple(device_step), tuple(cast), tuple(float(x) for x in host_bytes),
        host.dram_bandwidth, host.duplex_bandwidth or dev.duplex_bandwidth, cast_once=fmt.mixed,
        save_seconds=tuple(x / host.dram_bandwidth for x in save) if host.dram_bandwidth else (),
        save_bytes=tuple(save),
    )  # fmt: skip


class _Activations:
    """Activation plans by device room reserved for model state: the joint search on the sequence with that
    many bytes added to every step (cached), and of the plans it judged, the fastest whose swapped activations
    the host has room for (the search itself does not count host memory)."""

    def __init__(self, seq: Sequence, table, budget: int, dev: DeviceProfile, strategy: str, evaluations: int) -> None:
        self.seq, self.table, self.budget, self.dev = seq, table, budget, dev
        self.strategy, self.evaluations = strategy, evaluations
        self.plans: dict[int, list[Outcome]] = {}

    def grid(self, room: int) -> int:
        """``room`` rounded up to the grid (more room kept for model state: never less safe)."""
        q = max(1, self.budget // ROOM_GRID)
        return -(-room // q) * q

    def at(self, room: int, host_room: Optional[int] = None) -> Optional[Outcome]:
        """The fastest activation plan with ``room`` kept for model state whose swapped activations take at most
        ``host_room`` host bytes (None: any)."""
        if room not in self.plans:
            reserved = replace(self.seq, nonswap=[x + room for x in self.seq.nonswap])
            ev = Evaluator(reserved, self.table, self.budget, self.dev.h2d_bandwidth, self.dev.d2h_bandwidth)
            if self.strategy == "auto":
                found = search(ev, self.evaluations)
                judged = [found.best, *found.baselines.values()]
            else:
                judged = [BASELINES[self.strategy](ev)]
            self.plans[room] = sorted((o for o in judged if o.feasible), key=lambda o: o.step_time)
        fits = [o for o in self.plans[room] if host_room is None or swapped_bytes(o) <= host_room]
        return fits[0] if fits else None


def swapped_bytes(o: Outcome) -> int:
    """Host bytes of the activations an activation plan swaps out (each once)."""
    if o.schedule is None or o.sequence is None:
        return 0
    return sum(o.sequence.sizes[v] for v in {v for step in o.schedule.swap_out for v in step})


@dataclass
class _Prepared:
    """A model-state plan placed on an activation plan, scheduled under the budget (``_prepare``)."""

    placed: Placed
    activations: Outcome  # the activation plan it is placed on
    room: int  # device bytes kept for model state while the activations were planned


def _prepare(acts: _Activations, room: int, buckets: list[Bucket], uses: list[BucketUses], plan: ModelStatePlan,
             fmt: StateFormat, prices: ModelStatePrices, in_flight: int,
             host_room: Optional[int] = None) -> Union[_Prepared, str]:  # fmt: skip
    """``plan`` on the activation plan for ``room`` (whose swapped activations fit ``host_room``), scheduled
    under the budget (``place``); or why it does not fit."""
    fetch = [b.master_bytes if fmt.cast == "device" else b.weight_bytes for b in buckets]
    room = acts.grid(max(room, reserve(buckets, uses, plan, in_flight, fetch)))
    act = acts.at(room, host_room)
    if act is None:
        where = "" if host_room is None else f" and {host_room / 1e9:.0f} GB of host memory left for activations"
        return f"no activation plan fits with {room / 2**30:.1f} GiB kept for model state{where}"
    holds = act.model.holds if act.model is not None and act.model.holds else None
    seq = replace(act.sequence, nonswap=[max(0, x - room) for x in act.sequence.nonswap])
    try:
        placed = place(seq, buckets, uses, plan, acts.budget, prices, in_flight=in_flight, fetch_bytes=fetch,
                       holds=holds, compute=acts.seq.compute)  # fmt: skip
    except InfeasibleBudget as e:
        return str(e).split(". ")[0]
    return _Prepared(placed, act, room)


def _result(name: str, prep: Union[_Prepared, str], plan: ModelStatePlan, room: int, tokens: int,
            host: HostProfile, *, prices: ModelStatePrices, buckets: list[Bucket], uses: list[BucketUses],
            timing: str, in_flight: int, kernel: str) -> OffloadResult:  # fmt: skip
    """Schedule ``name``'s result: ``plan`` simulated on ``prep`` (or why it does not fit)."""
    s = SCHEDULES[name]
    r = OffloadResult(name, s.label, False, "", plan=plan, room=room, clipping=s.clipping, timing=timing,
                      kernel=kernel, buckets=list(buckets))  # fmt: skip
    if isinstance(prep, str):
        r.why = prep
        return r
    r.activations, r.room = _describe(prep.activations), prep.room
    sim = simulate_placed(prep.placed, buckets, uses, plan, prices, timing, in_flight)
    r.fits, r.sim, r.step_time, r.tokens_per_s = True, sim, sim.step_time, tokens / sim.step_time
    r.device_peak, r.pinned_bytes = prep.placed.schedule.peak, plan.pinned_bytes
    r.host_bytes = plan.host_bytes + prep.placed.pool
    if r.host_bytes > host.memory:
        r.fits = False
        r.why = f"needs {r.host_bytes / 1e9:.0f} GB of host memory, the host has {host.memory / 1e9:.0f} GB"
    return r


def forecast_offload(
    trace: Trace,
    model_fn: Callable,
    *,
    batch: int,
    tokens: int,
    budget: int,
    dev: DeviceProfile,
    host: HostProfile,
    fmt: Optional[StateFormat] = None,
    schedules: Seq[str] = DEFAULT_SCHEDULES,
    placement: str = "auto",
    kernel: str = RUNTIME_DEFAULT_KERNEL,
    model_bytes: Optional[int] = None,
    activations: str = "auto",
    bucket_bytes: Optional[int] = None,
    min_bytes: int = 1 << 20,
    in_flight: int = 2,
    name: str = "model",
    say: Callable[[str], None] = lambda _m: None,
) -> OffloadForecast:
    """Every schedule in ``schedules`` (``SCHEDULES``) on ``trace`` (one training step at ``batch``, captured
    with a stateless optimizer: ``swap.forecast.model_state.stateless_optimizer``) under ``budget`` (Note
    [Offload schedules side by side]). ``fmt``: the math the baselines keep (master and state dtypes, the compute
    dtype); ours keeps it as the runtime does (Note [What the runtime runs]). ``placement`` is ours: "auto",
    "streamed", "host_master" or "resident" (``plan_model_state``); ``bucket_bytes``: None, the runtime's default
    for these weights under ``budget`` (Note [Bucket size by default]); ``kernel``: ours' host optimizer kernel
    (``host_kernel``);
    ``model_bytes``: bytes an element of the model's parameters, what ours keeps every role in (None: the master's,
    an fp32 model trained with autocast in ``fmt.weight``'s dtype)."""
    fmt = fmt or StateFormat()
    placement = placement_named(placement, "placement")
    if kernel not in KERNELS:
        raise ValueError(f"unknown host optimizer kernel {kernel!r}: choose one of {', '.join(KERNELS)}")
    for s in schedules:
        if s not in SCHEDULES:
            raise ValueError(f"unknown offload schedule {s!r}: choose among {', '.join(SCHEDULES)}")
    if min_bytes and not access_events(trace, min_bytes=min_bytes):
        # every saved tensor is below min_bytes (a small model at a small batch): none would move, but the buckets
        # still need the steps that read them, so the sequence keeps them all
        say(f"no saved tensor reaches min_bytes ({min_bytes} bytes): model state placed among all of them")
        min_bytes = 0
    seq = sequence_from_trace(trace, cost=dev, min_bytes=min_bytes)
    layout = layout_from_trace(trace, model_fn, fmt, bucket_bytes, min_bytes=min_bytes, budget=budget)
    seq = replace(seq, nonswap=[max(0, a - b) for a, b in zip(seq.nonswap, layout.trace_bytes)])
    table = table_from_trace(trace, min_bytes=min_bytes, seconds=event_seconds(trace, dev))
    acts = _Activations(seq, table, budget, dev, activations, AUTO_EVALUATIONS)
    out = OffloadForecast(name, batch, tokens, budget, dev.name, host.name, fmt.describe(), layout.numel(),
                          sum(seq.compute), host.memory)  # fmt: skip
    for s in schedules:
        sf = SCHEDULES[s].format(fmt, model_bytes)
        k = SCHEDULES[s].kernel or kernel
        if SCHEDULES[s].placement is None:  # ours: packed as the runtime packs the model (Note [One packer])
            buckets, uses = layout.pack(sf, bucket_bytes)
            prices = prices_for(buckets, sf, dev, host, k)
            out.results[s] = _ours(s, acts, buckets, uses, sf, prices, host, placement, in_flight, tokens, say, k,
                                   layout.accumulation(sf, bucket_bytes))  # fmt: skip
        else:
            buckets = rebucket(layout, sf)
            prices = prices_for(buckets, sf, dev, host, k)
            plan = with_bytes(buckets, ModelStatePlan.uniform(len(buckets), SCHEDULES[s].placement), in_flight)
            room = acts.grid(plan.device_bytes)
            spare = host.memory - plan.host_bytes
            prep = _prepare(acts, room, buckets, layout.uses, plan, sf, prices, in_flight, spare)
            out.results[s] = _result(s, prep, plan, room, tokens, host, prices=prices, buckets=buckets,
                                     uses=layout.uses, timing=SCHEDULES[s].timing, in_flight=in_flight,
                                     kernel=k)  # fmt: skip
        r = out.results[s]
        r.format = sf.describe()
        say(f"{s}: " + (f"{r.tokens_per_s:.0f} tokens/s" if r.fits and r.tokens_per_s else f"does not fit ({r.why})"))
    return out


def _ours(name: str, acts: _Activations, buckets: list[Bucket], uses: list[BucketUses], fmt: StateFormat,
          prices: ModelStatePrices, host: HostProfile, placement: str, in_flight: int, tokens: int,
          say: Callable[[str], None], kernel: str, accumulation: int = 0) -> OffloadResult:  # fmt: skip
    """The fastest of our plans over the device rooms and resident shares tried (Note [Offload schedules
    side by side]): ``ROOM_SHARES`` of the budget, the plans ``candidates`` makes for them (Note [One chooser] in
    swap/schedule/model_state/choice.py), each on its own activation plan and host share."""
    best: Optional[OffloadResult] = None
    why = "no plan fits"
    rooms = [acts.grid(int(share * acts.budget)) for share in ROOM_SHARES]  # of the budget, on the grid
    for c in candidates(buckets, rooms, placement=placement, in_flight=in_flight, host_memory=host.memory,
                        accumulation=accumulation):  # fmt: skip
        if c.plan is None:
            why = str(c.refused)
            continue
        plan, room, timing = c.plan, c.room, SCHEDULES[name].timing
        spec = with_speculation(buckets, plan, host.memory, in_flight, accumulation)
        if spec is not None:  # Note [What the runtime runs]: the runtime speculates where the copies fit
            plan, timing = spec, "speculative"
        spare = host.memory - plan.host_bytes
        tried: set[int] = set()
        for pool in HOST_SHARES:  # host memory for swapped activations
            prep = _prepare(acts, room, buckets, uses, plan, fmt, prices, in_flight, int(pool * spare))
            if isinstance(prep, _Prepared) and id(prep.activations) in tried:
                continue  # the same activation plan as with more host memory: the same result
            tried.add(id(prep.activations) if isinstance(prep, _Prepared) else -len(tried) - 1)
            r = _result(name, prep, plan, room, tokens, host, prices=prices, buckets=buckets, uses=uses,
                        timing=timing, in_flight=in_flight, kernel=kernel)  # fmt: skip
            if r.fits and (best is None or not best.fits or r.step_time < best.step_time):
                best = r
            elif best is None:
                best = r
            why = r.why or why
    if best is None:  # no room tried holds a plan: say why (the largest room's refusal is the last)
        s = SCHEDULES[name]
        return OffloadResult(name, s.label, False, why, clipping=s.clipping, timing=s.timing, kernel=kernel)
    if best.fits:
        say(f"{name}: room {best.room / 2**30:.1f} GiB, placements resident/host-master/streamed {best.placements()}")
    return best


def _describe(o: Optional[Outcome]) -> str:
    if o is None:
        return "-"
    s = o.strategy
    return f"{s.plan.describe()}, swap {s.swap}"


def rebucket(layout: Layout, fmt: StateFormat) -> list[Bucket]:
    """``layout``'s buckets (the same parameters in each) with their bytes in ``fmt``."""
    out = []
    for b in layout.buckets:
        p = fmt.param("", b.numel)
        out.append(replace(b, weight_bytes=p.weight_bytes, master_bytes=p.master_bytes, grad_bytes=p.grad_bytes,
                           state_bytes=p.state_bytes, mixed=fmt.mixed))  # fmt: skip
    return out


OptimizerFn = Callable[[Any], torch.optim.Optimizer]


def state_format(optimizer: Optional[OptimizerFn], dtype: Optional[torch.dtype]) -> StateFormat:
    """The format the user trains in: the optimizer's kind (its class: AdamW, Adam, SGD with or without
    momentum; default AdamW) and, with bf16/fp16 weights, fp32 master and state (mixed precision), else the
    weights' dtype throughout."""
    kind = "adamw"
    if optimizer is not None:
        opt = optimizer([torch.nn.Parameter(torch.empty(1, device="meta"))])
        name = type(opt).__name__.lower()
        momentum = opt.param_groups[0].get("momentum", 0)
        kind = {"adamw": "adamw", "adam": "adam", "sgd": "sgd" if momentum else "sgd_plain"}.get(name, "adamw")
    low = dtype in (torch.bfloat16, torch.float16)
    weight = 2 if low else 4 if dtype in (None, torch.float32) else torch.empty(0, dtype=dtype).element_size()
    return StateFormat(kind, weight, 4 if low else weight, weight, 4 if low else weight)


def host_kernel(optimizer: Optional[OptimizerFn]) -> str:
    """The kernel the runtime's host step runs for the user's optimizer, as swap/runtime/model_state/host_optim.py
    chooses it (Note [What the runtime runs]): fused where the user left torch's default (``RUNTIME_DEFAULT_KERNEL``)
    or asked for it, else the user's own: ``foreach=True`` the foreach kernel, any other choice (``foreach=False``,
    ``fused=False``, ``differentiable=True``) or a class without a fused CPU kernel the per-tensor loop."""
    if optimizer is None:
        return RUNTIME_DEFAULT_KERNEL
    opt = optimizer([torch.nn.Parameter(torch.empty(1, device="meta"))])
    group = opt.param_groups[0]
    if group.get("fused"):
        return "fused"
    if group.get("foreach"):
        return "foreach"
    chose = group.get("foreach") is not None or group.get("fused") is not None or group.get("differentiable")
    fused_class = isinstance(opt, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD))
    return "for-loop" if chose or not fused_class else RUNTIME_DEFAULT_KERNEL


def forecast_model(model_fn: Callable[[], torch.nn.Module], batch_fn: Callable[[int], Any], loss_fn: Any, *,
                   batch: int, budget: int, dev: DeviceProfile, host: HostProfile, policy: ModelStatePolicy,
                   optimizer: Optional[OptimizerFn] = None,
                   dtype: Optional[torch.dtype] = None, min_bytes: int = 1 << 20, target: str = "cuda",
                   name: str = "model", say: Callable[[str], None] = lambda _m: None) -> OffloadForecast:  # fmt: skip
    """``swap.plan(model_state=policy)``: one training step at ``batch`` captured with a stateless optimizer
    (Note [Model state from a trace]) and every offload schedule forecast on it, in the format the user's
    optimizer and dtype say (``state_format``), ours in the model's own dtype with the host kernel the runtime
    runs for that optimizer (Note [What the runtime runs]). Tokens are the batch's elements of its first input."""
    mixed = policy.compute_dtype is not None
    if mixed:  # Note [Mixed precision pricing]: the device computes as a model in compute_dtype does
        check_mixed(dtype, policy)
    trace = capture(model_fn, batch_fn, batch, loss_fn, optimizer=stateless_optimizer,
                    dtype=policy.compute_dtype if mixed else dtype, target=target, name=name)  # fmt: skip
    say(f"model state: captured batch {batch} ({len(trace)} events)")
    first = batch_fn(batch)
    if isinstance(first, dict):
        first = next(iter(first.values()))
    elif isinstance(first, (tuple, list)):
        first = first[0]
    tokens = int(first.numel()) if isinstance(first, torch.Tensor) and not first.is_floating_point() else batch
    fmt = mixed_format(optimizer, policy.compute_dtype) if mixed else state_format(optimizer, dtype)
    return forecast_offload(trace, model_fn, batch=batch, tokens=tokens, budget=budget, dev=dev, host=host, fmt=fmt,
                            placement=policy.placement, bucket_bytes=policy.bucket_bytes, min_bytes=min_bytes,
                            name=name, say=say, kernel=host_kernel(optimizer),
                            model_bytes=model_bytes(None if mixed else dtype))  # fmt: skip


def mixed_format(optimizer: Optional[OptimizerFn], compute_dtype: torch.dtype) -> StateFormat:
    """What ``SwapManager(compute_dtype=)`` keeps for an fp32 model (Note [Mixed precision pricing]): weights and
    gradients on the device in ``compute_dtype``, fp32 master, gradient buffers and optimizer state on the host,
    the master cast on the host; ``mixed``."""
    return replace(state_format(optimizer, compute_dtype), cast="host", mixed=True)


def check_mixed(dtype: Optional[torch.dtype], policy: ModelStatePolicy) -> None:
    """Refuses, as the runtime does (``swap.runtime.model_state.precision``), what mixed precision cannot train: a
    model in half precision (it keeps fp32 masters) and the "resident" placement (the host steps the masters)."""
    if dtype is not None and dtype != torch.float32:
        raise ValueError(f"compute_dtype={policy.compute_dtype} keeps fp32 masters, and dtype={dtype} trains the model "
                         "in another dtype: leave dtype None (an fp32 model) with compute_dtype, or compute_dtype None "
                         "to train the model as it is")  # fmt: skip
    if policy.placement == "resident":
        raise ValueError("compute_dtype= keeps fp32 masters and optimizer state on the host, and placement='resident' "
                         "keeps the model state on the device: use placement='auto' or 'streamed' with compute_dtype")


def model_bytes(dtype: Optional[torch.dtype]) -> int:
    """Bytes an element of a model's parameters in ``dtype`` (None: fp32)."""
    return torch.empty(0, dtype=dtype or torch.float32).element_size()
