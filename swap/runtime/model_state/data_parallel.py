"""Model wrappers offloaded model state cannot run under, refused at entry with what to use instead: DDP, and a
model compiled whole with ``torch.compile``.

Note [Model state under DDP]
DDP all-reduces gradients from its own autograd hooks, once every gradient of a bucket of its is ready. The
model-state runtime takes each gradient off the device the moment autograd has made it (Note [Gradients on the
host] in swap.runtime.model_state.gradients), before DDP's reducer runs: DDP then all-reduces zeros, and each
rank's host step applies its own local gradient, so the ranks' parameters drift apart silently. Offloading after
the all-reduce (from a DDP communication hook) is not built, so the manager refuses at entry. The sharded path is
FSDP2's (``swap.fsdp2``: each rank offloads its own shard by a byte budget and ``HostSteps`` runs the update on the
host); with ``model_state=swap.ModelStatePolicy(placement='resident')`` the manager leaves parameters,
gradients and optimizer state to DDP and manages only the activations, which DDP does not touch.

Note [Model state and torch.compile]
Weights are streamed from module forward hooks, saved-tensor hooks and the parameter guard (Note [Weight uses] in
swap.runtime.model_state.streaming). A model compiled whole runs its forward and its backward as one graph each, so
every weight is one use of the whole graph: streaming would have to hold the whole model, and the manager used to
answer with an ``InfeasibleBudget`` at any budget below it. So ``model=torch.compile(m)`` is refused at entry,
naming the two ways that run: the model uncompiled with its state managed, or compiled with
``model_state=swap.ModelStatePolicy(placement='resident')`` (the activations are still managed).
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel


def refuse_ddp(model: torch.nn.Module) -> None:
    """Raises ``ValueError`` when ``model`` is, or holds, a ``DistributedDataParallel`` module (Note [Model state
    under DDP])."""
    for name, module in model.named_modules():
        if isinstance(module, DistributedDataParallel):
            where = "model= is" if not name else f"model= holds ({name!r})"
            raise ValueError(
                f"{where} a DistributedDataParallel module: DDP all-reduces gradients in its own hooks, after the "
                "SwapManager has taken them off the device, so every rank would step its own local gradient and the "
                "ranks would diverge. Offloaded model state is not supported under DDP: shard it with FSDP2 and "
                "offload each rank's shard (swap.fsdp2.offload_by_budget, swap.fsdp2.shard, swap.fsdp2.HostSteps; "
                "docs/model_state.md, 'FSDP2 offload'), or keep the model state on the device with "
                "model_state=swap.ModelStatePolicy(placement='resident') (the activations are still managed)"
            )  # fmt: skip


def refuse_compiled(model: torch.nn.Module) -> None:
    """Raises ``ValueError`` when ``model`` is a ``torch.compile`` wrapper (Note [Model state and torch.compile])."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise ValueError(
            "model= is compiled whole with torch.compile: a compiled graph reads every weight at once, so the "
            "SwapManager cannot stream its weights in buckets (it would have to hold the whole model). Pass the "
            "uncompiled module (model=compiled._orig_mod, and run it uncompiled) to place its state under the "
            "budget, or keep the model state on the device with model_state=swap.ModelStatePolicy(placement="
            "'resident') to train it compiled"
        )  # fmt: skip
