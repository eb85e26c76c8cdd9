"""One rank of FSDP2 training, forecast from a single-device capture: its memory (the rank's shard of parameters,
gradients and optimizer state, FSDP2's all-gather and reduce-scatter buffers) as a trace of that rank, and
its step time with the collectives priced on a named interconnect (swap.devices.INTERCONNECTS).

Note [One rank of FSDP2]
``fully_shard`` on each block (and on the root) makes each a unit whose parameters are sharded on dim 0 (padded
to a multiple of the world size w). A rank's training step, as FSDP2 (torch 2.13, one mesh dimension, default
settings) runs it, differs from the single-device step only in these allocations; the capture's events are
rewritten accordingly (``rank_trace``), so the schedule, the simulator and the replay see one rank:
- parameters: each parameter's allocation becomes its shard; buffers stay whole (FSDP2 does not shard them);
- optimizer state, and the optimizer step's temporaries and operators: on shards (sized like the shard of the
  parameter of the same size, else 1/w);
- forward, unit u (not the root): before its first operator FSDP2 all-gathers: a flat buffer of the unit's
  unsharded bytes S_u (the all-gather's input is a view into it), then the unsharded parameters (S_u), copied
  out of it. The flat buffer is kept until the next unit's copy-out (so that copy overlaps the next all-gather),
  and the parameters are freed after the unit's last operator (``reshard_after_forward``). The root is
  all-gathered first and stays unsharded until the end of the backward (FSDP2 does not reshard the root after
  forward); its post-forward frees the last flat buffer;
- backward, unit u: its pre-backward all-gathers it into a flat buffer unless it was prefetched, copies the
  parameters out of it and frees it, then prefetches the next unit in backward order (the all-gather into its
  flat buffer; the copy-out waits for that unit's pre-backward). The root's pre-backward prefetches the
  first. After u's last backward operator its post-backward frees its parameters, copies its unsharded
  gradients (the capture's gradient allocations, made by autograd) into a reduce-scatter input of S_u, frees
  them, and reduce-scatters into its sharded gradient (the shard's bytes, kept until the capture frees the
  gradients: ``zero_grad``). One reduce-scatter input is kept in flight: the previous unit's is freed before
  the next is made, the last at the end of the backward. The root's post-backward runs at the end of the
  backward.
With model-state offload (``Fsdp2.offload``, Note [Model-state offload on one rank]) the rank holds no model
state on the device: parameter shards, sharded gradients (each one a transient until its copy to the host),
optimizer state and the optimizer step's temporaries go, and so does the optimizer step's compute; each
offloaded unit's all-gather gets a copy-in buffer of its master shard, freed once the all-gather's input is
made. The resident units' model state, held all step, is the caller's to take off the budget
(``Offload.resident``).
What the rewrite does not model: mixed precision (``MixedPrecisionPolicy``: the capture's dtype is the
parameters', the gradients' and the collectives'), HSDP and explicit prefetch settings.

Note [Collectives on the step]
Each unit is all-gathered twice (forward, backward) and reduce-scattered once per step, each priced on the
interconnect (Note [Interconnect profiles] in swap/devices.py). They run on one communication lane beside the
compute: in the forward the all-gather of unit u+1 starts when that of u ends and u's compute has begun
(FSDP2's implicit prefetch, one unit ahead); in the backward the all-gather of the next unit starts at u's
pre-backward and the reduce-scatter of u after u's backward. A unit's compute waits for its all-gather; the
root's all-gather at the start and its reduce-scatter at the end are exposed. The exposed seconds (the lane's
end past the compute's) are added to every simulated step at that batch; recompute (which lengthens a unit's
backward and hides more) is not credited, so a recompute plan's step is a slight over-estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

from ..capture.trace import ALLOC, FREE, OP, PHASE, TAG, Trace
from ..devices import DeviceProfile, InterconnectProfile
from ..joint.ops import nested
from ..schedule.model_state.units import shard_of
from .fsdp2_lanes import Offload, RankStep, UnitSeconds, simulate_rank
from .fsdp2_units import Fsdp2, Unit, default_units, fsdp2
from .pricing import event_seconds

SHARDINGS = ("fsdp2", "fsdp2-offload")


# -- one rank's trace ---------------------------------------------------------------------------------------
@dataclass
class _Iteration:
    """Where each unit's operators are in one iteration: first and last forward and backward event."""

    first_fwd: dict[str, int] = field(default_factory=dict)
    last_fwd: dict[str, int] = field(default_factory=dict)
    first_bwd: dict[str, int] = field(default_factory=dict)
    last_bwd: dict[str, int] = field(default_factory=dict)
    model_fwd_end: int = -1  # the model's last forward operator (the root's post-forward follows it)
    bwd_end: int = -1


def _unit_of(fs: Fsdp2) -> Callable[[Optional[str]], str]:
    paths = sorted((u.path for u in fs.units if u.path), key=len, reverse=True)
    cache: dict[Optional[str], str] = {}

    def unit(module: Optional[str]) -> str:
        if module not in cache:
            cache[module] = next((p for p in paths if module and nested(module, p)), "")
        return cache[module]

    return unit


def _layout(trace: Trace, b: int, e: int, unit_of: Callable[[Optional[str]], str]) -> _Iteration:
    it = _Iteration()
    fwd, bwd, rec = PHASE["forward"], PHASE["backward"], PHASE["recompute"]
    for k in range(b, e + 1):
        if trace.op[k] != OP:
            continue
        phase = int(trace.phase[k])
        module = trace.module_name(k)
        u = unit_of(module)
        if phase == fwd:
            it.first_fwd.setdefault(u, k)
            it.last_fwd[u] = k
            if module is not None:
                it.model_fwd_end = k
        elif phase in (bwd, rec):
            it.first_bwd.setdefault(u, k)
            it.last_bwd[u] = k
            it.bwd_end = k
    return it


class _Inserted:
    """FSDP2's allocations and frees, to emit before or after events of the capture, with fresh ids."""

    def __init__(self, first_id: int) -> None:
        self.before: dict[int, list[tuple]] = {}
        self.after: dict[int, list[tuple]] = {}
        self.next_id = first_id

    def alloc(self, at: dict, k: int, size: int, tag: int = TAG["temporary"]) -> int:
        i = self.next_id
        self.next_id += 1
        at.setdefault(k, []).append((ALLOC, i, size, tag))
        return i

    def free(self, at: dict, k: int, i: int, size: int, tag: int = TAG["temporary"]) -> None:
        at.setdefault(k, []).append((FREE, i, size, tag))


def rank_trace(trace: Trace, fs: Fsdp2) -> Trace:
    """``trace`` (a single-device capture of the model ``fs`` describes) as one rank of FSDP2 sees it (Note [One
    rank of FSDP2])."""
    if fs.world_size == 1:
        return trace
    weight_allocs = np.flatnonzero((trace.op == ALLOC) & (trace.tag == TAG["weight"])).tolist()
    if len(weight_allocs) < len(fs.params) or any(int(trace.size[k]) != nbytes
                                                  for k, (nbytes, _, _) in zip(weight_allocs, fs.params)):  # fmt: skip
        raise ValueError("the trace's parameter allocations do not match the model's parameters (the same model_fn "
                         "and dtype for the capture and the sharding?)")  # fmt: skip
    shard_of_id = {int(trace.id[k]): shard for k, (_, shard, _) in zip(weight_allocs, fs.params)}
    by_size: dict[int, int] = {}
    for nbytes, shard, _ in fs.params:
        by_size.setdefault(nbytes, shard)
    w = fs.world_size
    unit_of = _unit_of(fs)
    units = {u.path: u for u in fs.units}
    ins = _Inserted(int(trace.id.max()) + 1 if len(trace) else 0)
    off = fs.offload
    copy_in = {} if off is None else {u.path: u.shard_bytes * off.master_bytes // fs.itemsize for u in fs.units
                                      if u.path not in off.resident}  # fmt: skip
    for b, e in trace.iterations():
        _schedule(ins, _layout(trace, b, e, unit_of), units, copy_in)
    tmp, grad, opt = TAG["temporary"], TAG["grad"], PHASE["optimizer"]
    grad_unit: dict[int, str] = {}  # an unsharded gradient's allocation -> its unit
    live_grads: dict[str, list[tuple[int, int]]] = {}  # unit -> its unsharded gradients not freed yet
    freed_early: set[int] = set()  # unsharded gradients freed at their unit's post-backward
    sharded_grad: dict[str, tuple[int, int]] = {}  # unit -> its sharded gradient (id, bytes) while live
    rows: list[tuple[int, int, int, int, int]] = []  # op, id, size, tag, source event (-1: inserted)
    phase = -1

    def emit(k: int, at: dict) -> None:
        for row in at.pop(k, []):
            if row[0] == "grads":  # a post-backward: its unit's unsharded gradients go, its shard comes
                for gid, gbytes in live_grads.pop(row[1], []):
                    freed_early.add(gid)
                    rows.append((FREE, gid, gbytes, grad, -1))
                shard = units[row[1]].shard_bytes
                if off is not None:  # copied to the host at once: a transient on the device
                    rows.extend([(ALLOC, row[2], shard, grad, -1), (FREE, row[2], shard, grad, -1)])
                elif row[1] in sharded_grad:  # accumulated into the live shard: the new one is added and dropped
                    rows.extend([(ALLOC, row[2], shard, grad, -1), (FREE, row[2], shard, grad, -1)])
                else:
                    sharded_grad[row[1]] = (row[2], shard)
                    rows.append((ALLOC, row[2], shard, grad, -1))
            else:
                rows.append((*row, -1))

    for k in range(len(trace)):
        emit(k, ins.before)
        o, i, size, tag = int(trace.op[k]), int(trace.id[k]), int(trace.size[k]), int(trace.tag[k])
        if o == OP:
            phase = int(trace.phase[k])
        elif o in (ALLOC, FREE):
            if off is not None and ((tag == TAG["weight"] and i in shard_of_id) or tag == TAG["optimizer_state"]
                                    or (phase == opt and tag == tmp)):  # fmt: skip
                continue  # model state on the host
            if tag == TAG["weight"] and i in shard_of_id:
                size = shard_of_id[i]
            elif tag == grad and o == ALLOC:
                grad_unit[i] = unit_of(_module_before(trace, k))
                live_grads.setdefault(grad_unit[i], []).append((i, size))
            elif tag == grad and i in freed_early:
                u = grad_unit.get(i, "")
                if u in sharded_grad:  # the capture frees the gradients (zero_grad): the shard goes instead
                    sid, sbytes = sharded_grad.pop(u)
                    rows.append((FREE, sid, sbytes, grad, -1))
                continue
            elif tag == TAG["optimizer_state"] or (phase == opt and tag == tmp):
                size = by_size.get(size, -(-size // w))
        rows.append((o, i, size, tag, k))
        emit(k, ins.after)
    return _build(trace, rows, w, opt, 0 if off is not None else w)


def _module_before(trace: Trace, k: int) -> Optional[str]:
    """The module of the nearest operator event before ``k``."""
    j = k - 1
    while j >= 0 and trace.op[j] != OP:
        j -= 1
    return trace.module_name(j) if j >= 0 else None


def _schedule(ins: _Inserted, it: _Iteration, units: dict[str, Unit], copy_in: dict[str, int]) -> None:
    """One iteration's all-gather and reduce-scatter buffers (Note [One rank of FSDP2]); ``copy_in``: the master
    shard's bytes copied to the device before each all-gather of an offloaded unit."""
    if not it.first_fwd:
        return
    before, after = ins.before, ins.after
    root = units[""]
    params: dict[str, int] = {}  # unit -> its unsharded parameters' allocation, while live
    start = min(it.first_fwd.values())
    pending: Optional[tuple[int, int]] = None  # the flat all-gather buffer kept until the next copy-out
    if root.param_bytes:
        pending = (_flat(ins, start, "", root.param_bytes, copy_in), root.param_bytes)
        params[""] = ins.alloc(before, start, root.param_bytes)
    for _, u in sorted((k, u) for u, k in it.first_fwd.items() if u):
        k, s = it.first_fwd[u], units[u].param_bytes
        flat = _flat(ins, k, u, s, copy_in)
        if pending is not None:
            ins.free(before, k, *pending)
        params[u] = ins.alloc(before, k, s)
        pending = (flat, s)
        ins.free(after, it.last_fwd[u], params.pop(u), s)
    if pending is not None:
        ins.free(after, it.model_fwd_end if it.model_fwd_end >= 0 else max(it.last_fwd.values()), *pending)
    if not it.first_bwd:
        return
    backward = [u for _, u in sorted((k, u) for u, k in it.first_bwd.items() if u)]
    flats: dict[str, int] = {}  # unit -> its flat buffer (all-gathered, not copied out yet)

    def gather(k: int, u: str) -> None:
        flats[u] = _flat(ins, k, u, units[u].param_bytes, copy_in)

    if backward:  # the root's pre-backward prefetches the first unit
        gather(min(it.first_bwd.values()), backward[0])
    rs: Optional[tuple[int, int]] = None  # the reduce-scatter input in flight
    for n, u in enumerate(backward):
        k, s = it.first_bwd[u], units[u].param_bytes
        if u not in flats:
            gather(k, u)
        params[u] = ins.alloc(before, k, s)  # the copy-out, then the flat buffer goes
        ins.free(before, k, flats.pop(u), s)
        if n + 1 < len(backward):
            gather(k, backward[n + 1])
        rs = _post_backward(ins, it.last_bwd[u], units[u], params, rs)
    rs = _post_backward(ins, it.bwd_end, root, params, rs)
    if rs is not None:
        ins.free(after, it.bwd_end, *rs)


def _flat(ins: _Inserted, k: int, u: str, size: int, copy_in: dict[str, int]) -> int:
    """Unit ``u``'s flat all-gather buffer of ``size`` bytes, before event ``k``; an offloaded unit's master shard
    is copied to the device first and freed once the all-gather's input is made from it."""
    copy = copy_in.get(u, 0)
    i = ins.alloc(ins.before, k, copy) if copy else -1
    flat = ins.alloc(ins.before, k, size)
    if copy:
        ins.free(ins.before, k, i, copy)
    return flat


def _post_backward(ins: _Inserted, k: int, unit: Unit, params: dict[str, int],
                   rs: Optional[tuple[int, int]]) -> Optional[tuple[int, int]]:  # fmt: skip
    """Unit ``unit``'s post-backward after event ``k``; returns its reduce-scatter input, now in flight."""
    if unit.path in params:
        ins.free(ins.after, k, params.pop(unit.path), unit.param_bytes)
    if rs is not None:
        ins.free(ins.after, k, *rs)
    if not unit.param_bytes:
        return None
    new_rs = ins.alloc(ins.after, k, unit.param_bytes)
    ins.after[k].append(("grads", unit.path, ins.next_id, 0))  # the shard's id: reserved here
    ins.next_id += 1
    return new_rs, unit.param_bytes


def _build(trace: Trace, rows: list, w: int, phase_opt: int, opt_share: int) -> Trace:
    """The trace of ``rows``; the optimizer's operators cost 1/``opt_share`` (0: none, it steps on the host)."""
    src = np.array([r[4] for r in rows], dtype=np.int64)
    has = src >= 0
    n = len(rows)

    def take(a: np.ndarray, fill: Any) -> np.ndarray:
        out = np.full(n, fill, dtype=a.dtype)
        out[has] = a[src[has]]
        return out

    flops, nbytes = take(trace.flops, 0.0), take(trace.bytes, 0.0)
    phase = take(trace.phase, -1)
    opt = (phase == phase_opt) & (take(trace.op, 0) == OP)
    flops[opt] = flops[opt] / opt_share if opt_share else 0.0
    nbytes[opt] = nbytes[opt] / opt_share if opt_share else 0.0
    meta = dict(trace.meta, ranks=w, sharding="fsdp2")
    return Trace(np.array([r[0] for r in rows], dtype=np.uint8), np.array([r[1] for r in rows], dtype=np.int64),
                 np.array([r[2] for r in rows], dtype=np.int64), np.array([r[3] for r in rows], dtype=np.uint8),
                 take(trace.stream, 0), flops, nbytes, meta, take(trace.module, -1), phase,
                 take(trace.precision, -1))  # fmt: skip


# -- the collectives on the step ----------------------------------------------------------------------------
def exposed_collectives(trace: Trace, fs: Fsdp2, dev: DeviceProfile) -> float:
    """Seconds per step the collectives (and, with ``fs.offload``, the model state's copies and host steps) add to
    the compute of ``trace``'s last iteration (Note [Collectives on the step]); ``trace`` is a single-device or a
    rank's trace of the same model."""
    return 0.0 if fs.world_size == 1 else rank_step(trace, fs, dev).exposed


def rank_step(trace: Trace, fs: Fsdp2, dev: DeviceProfile) -> RankStep:
    """One rank's steady-state step on its lanes (swap.forecast.fsdp2_lanes.simulate_rank)."""
    return simulate_rank(unit_seconds(trace, fs, dev), 3 if fs.offload is not None else 1)  # offload: steady state


def unit_seconds(trace: Trace, fs: Fsdp2, dev: DeviceProfile) -> UnitSeconds:
    """What ``trace``'s last iteration costs per unit: compute, collectives, and with ``fs.offload`` the copies
    and host steps of Note [Model-state offload on one rank]."""
    b, e = trace.iterations()[-1]
    secs = event_seconds(trace, dev)
    unit_of = _unit_of(fs)
    it = _layout(trace, b, e, unit_of)
    fwd, bwd, rec = PHASE["forward"], PHASE["backward"], PHASE["recompute"]
    blocks_fwd = min((k for u, k in it.first_fwd.items() if u), default=e + 1)
    blocks_bwd = min((k for u, k in it.first_bwd.items() if u), default=e + 1)
    compute: dict[tuple[str, str], float] = {}  # (unit or "root:head"/"root:tail", "f"/"b") -> seconds
    for k in range(b, e + 1):
        if trace.op[k] != OP or trace.phase[k] not in (fwd, bwd, rec):
            continue
        u, f = unit_of(trace.module_name(k)), "f" if trace.phase[k] == fwd else "b"
        if not u:  # the root's own operators, before or after the blocks (embeddings, head, loss)
            u = "root:head" if k < (blocks_fwd if f == "f" else blocks_bwd) else "root:tail"
        compute[u, f] = compute.get((u, f), 0.0) + float(secs[k])
    comm = {u.path: fs.link.collective_seconds(u.param_bytes, fs.world_size) for u in fs.units}
    order = lambda first: tuple(u for _, u in sorted((k, u) for u, k in first.items() if u))  # noqa: E731
    forward, backward = order(it.first_fwd), order(it.first_bwd)
    spec = fs.offload
    if spec is None:
        return UnitSeconds(forward, backward, compute, comm)
    host, numel = spec.profile, fs.shard_numel()
    off = [u for u in numel if u not in spec.resident]
    h2d, d2h = host.h2d_bandwidth or dev.h2d_bandwidth, host.d2h_bandwidth or dev.d2h_bandwidth
    rate = host.optimizer_rate(spec.optimizer) / spec.ranks_per_host  # the ranks on one host step at once
    dram = sum(spec.host_step_bytes(numel[u]) + numel[u] * ((1 if u == "" else 2) * spec.master_bytes
                                                          + spec.grad_bytes) for u in off)  # fmt: skip
    device = sum(spec.host_step_bytes(numel[u]) for u in numel if u in spec.resident)
    return UnitSeconds(forward, backward, compute, comm, h2d={u: numel[u] * spec.master_bytes / h2d for u in off},
                       d2h={u: numel[u] * spec.grad_bytes / d2h for u in off},
                       host={u: spec.host_step_bytes(numel[u]) / rate for u in off},
                       device_step=device / (dev.mem_bandwidth * dev.efficiency),
                       dram_seconds=dram * spec.ranks_per_host / host.dram_bandwidth)  # fmt: skip


# -- the forecast of one rank -------------------------------------------------------------------------------
def sharding(model_fn: Callable[[], torch.nn.Module], world_size: int, shard: Union[str, Offload, None],
             link: Optional[Union[str, InterconnectProfile]],
             dtype: Optional[torch.dtype]) -> Optional[Fsdp2]:  # fmt: skip
    """``swap.plan``'s ``world_size``, ``shard`` and ``interconnect``: None for one device, else the sharding
    ("fsdp2-offload", or an ``Offload``: with model-state offload, Note [Model-state offload on one rank])."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, not {world_size!r}")
    if shard is None and world_size == 1:
        if link is not None:
            raise ValueError("an interconnect prices the collectives of sharded training: pass world_size > 1 and "
                             "shard='fsdp2' too, or drop interconnect")  # fmt: skip
        return None
    if isinstance(shard, Offload):
        return fsdp2(model_fn, world_size, link or "nvlink4", dtype, offload=shard)
    if shard not in SHARDINGS:
        raise ValueError(f"unknown shard {shard!r}: with world_size={world_size}, pass shard= one of "
                         f"{', '.join(map(repr, SHARDINGS))} (how the ranks split the model)")  # fmt: skip
    offload = Offload() if shard == "fsdp2-offload" else None
    return fsdp2(model_fn, world_size, link or "nvlink4", dtype, offload=offload)


def with_collectives(plan: Any, trace_at: Callable[[int], Trace], fs: Fsdp2, dev: DeviceProfile) -> Any:
    """``plan`` (a ``swap.Plan`` of one rank's traces) with the collectives' exposed seconds added to every
    simulated step (Note [Collectives on the step]), and what one rank holds in its notes."""
    exposed: dict[int, float] = {}

    def slower(n: int, t: Optional[float]) -> Optional[float]:
        if not n or t is None:
            return t
        if n not in exposed:
            exposed[n] = exposed_collectives(trace_at(n), fs, dev)
        return t + exposed[n]

    for r in plan.policies.values():
        r.step_time = slower(r.max_batch, r.step_time)
        r.samples_per_s = r.max_batch / r.step_time if r.step_time else r.samples_per_s
    for s in plan.strategies.values():
        for n, p in s.points.items():
            if p.fits:
                p.step_time = slower(n, p.step_time)
                p.samples_per_s = n / p.step_time if p.step_time else p.samples_per_s
    plan.throughput = {p: r.samples_per_s for p, r in plan.policies.items()}
    held = model_state_per_rank(trace_at(min(exposed) if exposed else 1), fs)
    gib = float(2**30)
    plan.notes.insert(0, f"one rank of {fs.describe()}; per rank: parameters {held['parameters'] / gib:.2f} GiB, "
                         f"gradients {held['gradients'] / gib:.2f} GiB, optimizer state {held['state'] / gib:.2f} "
                         f"GiB, all-gather buffers up to {held['gather'] / gib:.2f} GiB; collectives exposed per step: "
                         + ", ".join(f"{t * 1e3:.1f} ms at batch {n}" for n, t in sorted(exposed.items())))  # fmt: skip
    if fs.offload is not None:  # what binds may change with the batch: one note per batch
        plan.notes[1:1] = [offload_note(rank_step(trace_at(n), fs, dev), fs, n) for n in sorted(exposed)]
    return plan


def offload_note(step: RankStep, fs: Fsdp2, batch: int) -> str:
    """What model-state offload costs one rank at ``batch`` (Note [Model-state offload on one rank])."""
    spec = fs.offload
    assert spec is not None
    off = [u.path or "root" for u in fs.units if u.path not in spec.resident]
    terms = ", ".join(f"{k} {v:.2f} s" for k, v in step.terms.items())
    return (f"model-state offload at batch {batch}: {len(off)} of {len(fs.units)} units on the host "
            f"{spec.profile.name!r} ({spec.ranks_per_host} ranks a host); its copies and host steps add "
            f"{step.exposed:.2f} s to the step (on the trace's forward and backward, {step.compute_time:.2f} s: "
            f"recompute and swaps not counted); per step: {terms}; bound by {step.bound}")


def model_state_per_rank(trace: Trace, fs: Fsdp2) -> dict[str, int]:
    """A rank's parameters, sharded gradients, optimizer state (live at the end of ``trace``, one rank's) and
    FSDP2's all-gather buffers at most: the root's unsharded parameters (held all step), the largest block's flat
    buffer and parameters, and the next block's prefetched flat buffer."""
    state = int(trace.size[(trace.op == ALLOC) & (trace.tag == TAG["optimizer_state"])].sum()
                - trace.size[(trace.op == FREE) & (trace.tag == TAG["optimizer_state"])].sum())  # fmt: skip
    sizes = sorted((u.param_bytes for u in fs.units if u.path), reverse=True)
    root = next(u.param_bytes for u in fs.units if not u.path)
    gather = root + (2 * sizes[0] + (sizes[1] if len(sizes) > 1 else 0) if sizes else 0)
    return {"parameters": fs.shard_bytes, "gradients": fs.shard_bytes, "state": state, "gather": gather}


__all__ = ["SHARDINGS", "Fsdp2", "Offload", "Unit", "default_units", "exposed_collectives", "fsdp2",
           "model_state_per_rank", "offload_note", "rank_step", "rank_trace", "shard_of", "sharding", "unit_seconds",
           "with_collectives"]
