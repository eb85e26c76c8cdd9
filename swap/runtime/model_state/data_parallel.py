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

Note [DDP that wraps the model later]
The entry check sees only a DDP module the manager is given. A trainer may wrap the model after the manager has
started: the HF Trainer and accelerate under ``torchrun``/``accelerate launch`` wrap it in DDP inside ``train()``
or ``prepare``. So the runtime also hooks the model's forward (``refuse_ddp_forward``): DDP's forward marks itself
as the active DDP module for its duration (``DistributedDataParallel._get_active_ddp_module``, the classmethod
TorchDynamo reads), and a forward of the managed model inside one is refused with the same message, before any
gradient is taken off the device, so the ranks never diverge. DDP's Python reducer (``_use_python_reducer``, a
private debugging mode) does not mark itself and is not caught.

Note [Model state and torch.compile]
Weights are streamed from module forward hooks, saved-tensor hooks and the parameter guard (Note [Weight uses] in
swap.runtime.model_state.streaming). A model compiled whole runs its forward and its backward as one graph each, so
every weight is one use of the whole graph: streaming would have to hold the whole model, and the manager used to
answer with an ``InfeasibleBudget`` at any budget below it. So ``model=torch.compile(m)`` is refused at entry,
naming the two ways that run: the model uncompiled with its state managed, or compiled with
``model_state=swap.ModelStatePolicy(placement='resident')`` (the activations are still managed).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel


def refuse_ddp(model: torch.nn.Module) -> None:
    """Raises ``ValueError`` when ``model`` is, or holds, a ``DistributedDataParallel`` module (Note [Model state
    under DDP])."""
    for name, module in model.named_modules():
        if isinstance(module, DistributedDataParallel):
            where = "model= is" if not name else f"model= holds ({name!r})"
            raise ValueError(ddp_message(where))


def refuse_ddp_forward(model: torch.nn.Module) -> Callable[[], None]:
    """Refuses a forward of ``model`` run by a ``DistributedDataParallel`` wrapper made after the manager started
    (Note [DDP that wraps the model later]); returns the hook's remover."""

    def pre(module: torch.nn.Module, args: Any) -> None:
        ddp = DistributedDataParallel._get_active_ddp_module()
        if ddp is not None and any(m is module for m in ddp.module.modules()):
            raise ValueError(ddp_message("model= was wrapped in DistributedDataParallel after the manager started "
                                         "(a trainer's train() or accelerate's prepare under torchrun): it is now "
                                         "run by"))  # fmt: skip

    return model.register_forward_pre_hook(pre, prepend=True).remove


def ddp_message(where: str) -> str:
    """The refusal's words (Note [Model state under DDP]), after ``where`` says how the model meets DDP."""
    return (
        f"{where} a DistributedDataParallel module: DDP all-reduces gradients in its own hooks, after the "
        "SwapManager has taken them off the device, so every rank would step its own local gradient and the "
        "ranks would diverge. Offloaded model state is not supported under DDP: shard it with FSDP2 and "
        "offload each rank's shard (swap.fsdp2.offload_by_budget, swap.fsdp2.shard, swap.fsdp2.HostSteps; "
        "docs/model_state.md, 'FSDP2 offload'), or keep the model state on the device with "
        "model_state=swap.ModelStatePolicy(placement='resident') (the activations are still managed)"
    )


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
