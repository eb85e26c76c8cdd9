"""Offloaded model state under data parallelism: refused under DDP, with what to use instead.

Note [Model state under DDP]
DDP all-reduces gradients from its own autograd hooks, once every gradient of a bucket of its is ready. The
model-state runtime takes each gradient off the device the moment autograd has made it (Note [Gradients on the
host] in swap.runtime.model_state.gradients), before DDP's reducer runs: DDP then all-reduces zeros, and each
rank's host step applies its own local gradient, so the ranks' parameters drift apart silently. Offloading after
the all-reduce (from a DDP communication hook) is not built, so the manager refuses at entry. The sharded path is
FSDP2's (``swap.fsdp2``: each rank offloads its own shard by a byte budget and ``HostSteps`` runs the update on the
host); with ``model_state='resident'`` the manager leaves parameters, gradients and optimizer state to DDP and
manages only the activations, which DDP does not touch.
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
                "model_state='resident' (the activations are still managed)"
            )  # fmt: skip
