"""The FSDP2 side of model state under the budget: shard a model with ``fully_shard``, offloading the units a byte
budget cannot hold; step the offloaded units on the host after ``opt.step()``, each unit's all-gather gated on its
pending host update; clip gradients across ranks with the user's one process group.

Note [Model state under FSDP2]
The rank's shard of parameters, gradients and optimizer state goes under the rank's budget by driving FSDP2's
own offload per unit, not by streaming the shard ourselves:
1. What torch offers. torch 2.13 has no per-parameter offload (no ``Mapping[FQN, OffloadPolicy]`` nor
   ``cpu_offload_by_budget``: those are an open pull request), but each ``fully_shard`` call takes its own
   ``offload_policy``, so offload is per unit: a block, the same unit FSDP2 all-gathers and reduce-scatters.
   Offloading by a budget is choosing that set of units, with public API only.
2. Where the shard must be. An offloaded unit's shard is needed on the device only for its all-gather's
   copy-in, and FSDP2 makes that copy itself, right before the all-gather, inside its own prefetching (one unit
   ahead in the forward, the next unit at each pre-backward). Streaming the shard ourselves would mean filling
   FSDP2's private per-parameter shard storage before every one of its all-gathers, prefetches included, whose
   timing is FSDP2's: private state, broken by any release. Sharding already divides the link's bytes by the
   world size, so a finer window than FSDP2's prefetch has little left to hide.
3. Checkpoints. An offloaded unit's parameters are sharded DTensors on the host: ``model.state_dict()`` and
   ``torch.distributed.checkpoint`` save and load them unchanged, with or without offload on either side.
4. Vocabulary. An offloaded unit is a ``STREAMED`` bucket of Note [Model-state placements] whose bucket is the
   FSDP2 unit and whose streaming is FSDP2's; a resident one is ``RESIDENT``. Its gradient shard leaves the
   device after the reduce-scatter (FSDP2's copy) and its update is a host step: the user's optimizer on the
   host shards (on CPU runs the very same kernel, so training is bitwise equal).
What this module adds:
- the choice (``offload_by_budget``, swap.schedule.model_state.units): units are offloaded from the last in the
  forward order backwards until the resident units' model state, FSDP2's buffers and the activations fit the
  rank's budget. The last units' gradients are the first of the backward (their copy and host step start
  earliest) and their updated shards are needed last in the next forward (their host step has the whole
  forward to hide behind); the root (embeddings, head) goes last. The choice depends on sizes only: ranks with
  the same budget choose the same units without a collective, and ranks with different budgets may differ,
  which FSDP2 allows (an all-gather's inputs have the same shapes wherever the shard lives).
- ``HostSteps`` (swap/runtime/model_state/fsdp2_steps.py, Note [Host steps of offloaded FSDP2 units]): the offloaded
  units' update taken out of the user's ``opt.step()`` and run on a host worker after the step confirms, by the
  single-device model-state runtime's host step (a shadow of the user's optimizer, hyperparameters copied from
  the user's param groups at every step, its state the user's own: ``opt.state_dict()`` and DCP stay plain),
  in forward order; ``gate_updates`` makes every unshard of an offloaded unit (its own pre-forward's, a forward
  prefetch's: Note [Every unshard gated]) wait for the unit's pending update, so the host step hides behind the
  forward of the units before it. Without ``HostSteps`` the user's ``opt.step()`` steps the host shards itself,
  synchronously, as FSDP2 does.
- ``clip_grad_norm_``: clipping by the global norm across ranks when the gradient shards live on two devices
  (the host for offloaded units, the GPU for the rest) and the process group is NCCL only, where
  ``torch.nn.utils.clip_grad_norm_`` fails (its DTensor all-reduce runs on host tensors). Per-tensor norms of
  the local shards are taken where they live, their p-th powers stacked on the group's device, summed over the
  ranks by one all-reduce (max for the infinity norm), and the total, the clamped coefficient and the scaling
  are torch's: on a gloo group, where torch's runs, the results are bitwise equal (tested on two ranks).
The forecast prices the offloaded units' shard copies and host steps (swap/forecast/distributed.py, Note
[Model-state offload on one rank]).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Optional

import torch

from ...schedule.model_state import STATE_TENSORS, HostMemoryError, ModelStatePolicy, Placement
from ...schedule.model_state.units import ShardPlan, blocks_of, choose_offloaded, shard_of
from ...units import fmt_bytes
from .fsdp2_steps import HostSteps, gate_updates


def default_units(model: torch.nn.Module) -> list[str]:
    """The blocks ``shard`` makes units of by default (swap.schedule.model_state.units.blocks_of)."""
    return blocks_of([n for n, m in model.named_modules() if any(True for _ in m.parameters())])


def unit_bytes(model: torch.nn.Module, units: list[str], world_size: int,
               state_per_param: float = STATE_TENSORS["adamw"]) -> dict[str, int]:  # fmt: skip
    """Per unit (and the root ""), the bytes one rank holds of it: its parameters' shards (dim 0 padded to a
    multiple of ``world_size``), as many of gradient, and ``state_per_param`` times as many of optimizer state
    (AdamW: 2)."""
    by_length = sorted(units, key=len, reverse=True)
    out = dict.fromkeys(["", *units], 0)
    for name, p in model.named_parameters():
        unit = next((u for u in by_length if name.startswith(u + ".")), "")
        out[unit] += int(shard_of(tuple(p.shape), p.element_size(), world_size) * (2 + state_per_param))
    return out


def offload_by_budget(model: torch.nn.Module, room: int, world_size: int, units: Optional[list[str]] = None,
                      state_per_param: float = STATE_TENSORS["adamw"],
                      policy: Optional[ModelStatePolicy] = None) -> ShardPlan:  # fmt: skip
    """The units (``default_units`` unless given) to offload so that the resident ones' model state fits
    ``room`` bytes of the rank's budget (what the activations and FSDP2's all-gather buffers leave), in the
    order Note [Model state under FSDP2] gives. ``policy`` (swap.ModelStatePolicy, the one ``SwapManager`` and
    ``swap.plan`` take; None: the default): its placement "auto" chooses by the budget, "streamed" offloads every
    unit, "resident" none; its ``host_memory`` caps the offloaded units' host bytes; its ``host_threads`` are
    ``HostSteps``'. Raises ValueError, saying what to change, if even offloading every unit does not fit, and
    for what FSDP2 cannot do (``NotImplementedError``)."""
    policy = ModelStatePolicy() if policy is None else policy
    _check_fsdp2_policy(policy)
    units = default_units(model) if units is None else list(units)
    sizes = unit_bytes(model, units, world_size, state_per_param)
    ordered = [("", sizes[""])] + [(u, sizes[u]) for u in units]
    if policy.placement == "auto":
        placements = choose_offloaded(ordered, room)
    else:
        placements = dict.fromkeys(sizes, Placement(policy.placement))
    plan = ShardPlan(placements, sizes, policy)
    if policy.placement != "resident" and plan.resident_bytes() > room:
        raise ValueError(f"no offload fits {room} bytes of model state per rank: the budget must leave room for "
                         "the all-gather buffers and activations; raise the budget or the world size")  # fmt: skip
    host = sum(b for u, b in sizes.items() if placements[u] is Placement.STREAMED)
    if policy.host_memory is not None and host > policy.host_memory:
        raise HostMemoryError(host, policy.host_memory, (
            f"the offloaded units' model state takes {fmt_bytes(host)} of this rank's host memory, and the policy's "
            f"host_memory is {fmt_bytes(policy.host_memory)}: raise host_memory, the budget (fewer units offloaded) "
            "or the world size"))  # fmt: skip
    return plan


def _check_fsdp2_policy(policy: ModelStatePolicy) -> None:
    """What FSDP2's per-unit offload cannot do with ``policy``, refused saying what to use instead."""
    if policy.placement == "host_master":
        raise NotImplementedError("FSDP2's CPU offload keeps no device copy of a unit between steps: use placement="
                                  "'streamed' (every unit offloaded) or 'auto' (units offloaded by the budget)")
    if policy.bucket_bytes is not None:
        raise ValueError("under FSDP2 a bucket is a unit (the blocks fully_shard wraps): leave bucket_bytes=None and "
                         "pass units= to offload_by_budget to choose them")  # fmt: skip
    if policy.compute_dtype is not None:
        raise NotImplementedError("under FSDP2, name the compute dtype with FSDP2's own MixedPrecisionPolicy "
                                  "(swap.fsdp2.shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=...))) and leave "
                                  "the policy's compute_dtype=None")  # fmt: skip


def shard(model: torch.nn.Module, plan: ShardPlan, pin_memory: Optional[bool] = None,
          **fully_shard_kwargs: Any) -> None:  # fmt: skip
    """``fully_shard`` on each unit of ``plan`` and then the root, with ``CPUOffloadPolicy`` on the offloaded
    ones (``pin_memory``: default when CUDA is available). Call it before building the optimizer: the shards'
    device is decided here."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    modules = dict(model.named_modules())
    for path in [u for u in plan.placements if u] + [""]:
        offload = plan.placements[path] is Placement.STREAMED
        policy = CPUOffloadPolicy(pin_memory=pin) if offload else OffloadPolicy()
        fully_shard(modules[path], offload_policy=policy, **fully_shard_kwargs)


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0,
                    group: Any = None) -> torch.Tensor:  # fmt: skip
    """Clips the gradients of ``parameters`` (FSDP2's DTensors, on the host or the device) by their global norm
    over the ranks of ``group`` (the default group if None), as ``torch.nn.utils.clip_grad_norm_`` does, with one
    all-reduce on the group's own device (Note [Model state under FSDP2]). Returns the total norm."""
    import torch.distributed as dist

    grads = [p.grad for p in parameters if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    backend = str(dist.get_backend(group)).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend and "gloo" not in backend \
        else torch.device("cpu")  # fmt: skip
    if not local:
        return torch.zeros((), device=device)
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type).to(device) for g in local])
    if math.isinf(norm_type):
        dist.all_reduce(norms, op=dist.ReduceOp.MAX, group=group)
        per_tensor = norms
    else:
        powered = norms.pow(norm_type)
        dist.all_reduce(powered, group=group)
        per_tensor = powered.pow(1.0 / norm_type)
    total = torch.linalg.vector_norm(per_tensor, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in local:
        g.mul_(coef.to(g.device))
    return total


__all__ = ["HostSteps", "ShardPlan", "clip_grad_norm_", "default_units", "gate_updates", "offload_by_budget", "shard",
           "unit_bytes"]
