"""Two CPU processes (gloo, ``bench.ranks.spawn``) training a small GPT with FSDP2 (``fully_shard`` on each block
and the root), with and without a SwapManager: what each rank saw, for the test in the parent process.

Every FSDP2 module counts its all-gathers (``FSDPModule.set_custom_all_gather``, FSDP2's public hook for its
all-gather), per iteration, so a test can tell whether a region rerun all-gathered again."""

from __future__ import annotations

import collections
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import swap
from bench.ranks import spawn  # noqa: F401 - the tests run their workers with it
from swap.forecast import zoo

VOCAB, SEQ, BATCH = 64, 128, 16


class CountingAllGather:
    """FSDP2's all-gather (``set_custom_all_gather``), counting its calls under ``name``."""

    def __init__(self, name: str, counts: collections.Counter) -> None:
        self.name, self.counts = name, counts

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False):
        self.counts[self.name] += 1
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(output_tensor, input_tensor, group=group, async_op=async_op)


def build(counts: collections.Counter, nested: bool = False) -> torch.nn.Module:
    """The model, sharded: each block a FSDP2 unit (``nested``: each block's ``fc`` one of its own too)."""
    torch.manual_seed(0)
    model = zoo.gpt(n_layer=4, n_head=4, d_model=64, vocab=VOCAB, seq_len=SEQ)
    for i, block in enumerate(model.blocks):
        if nested:
            fully_shard(block.fc)
            block.fc.set_custom_all_gather(CountingAllGather(f"blocks.{i}.fc", counts))
        fully_shard(block)
        block.set_custom_all_gather(CountingAllGather(f"blocks.{i}", counts))
    fully_shard(model)
    model.set_custom_all_gather(CountingAllGather("root", counts))
    return model


def train(rank: int, manager: Optional[Callable[[], swap.SwapManager]], iterations: int = 5,
          nested: bool = False) -> dict[str, Any]:  # fmt: skip
    """AdamW steps; losses, this rank's gradient shards (numpy), each iteration's peak (an independent meter)
    and all-gather counts, and the manager's plan."""
    counts: collections.Counter = collections.Counter()
    model = build(counts, nested)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out: dict[str, Any] = {"losses": [], "grads": [], "peaks": [], "gathers": []}
    meter = swap.LiveBytesMeter("cpu").track_existing()
    sm = manager() if manager is not None else None
    with meter:
        meter.reset_window()
        if sm is not None:
            sm.__enter__()
        try:
            for it in range(iterations):
                counts.clear()
                g = torch.Generator().manual_seed(100 * rank + it)
                tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
                opt.zero_grad()
                logits = model(tokens[:, :-1]).reshape(-1, VOCAB)
                loss = torch.nn.functional.cross_entropy(logits, tokens[:, 1:].reshape(-1))
                del logits
                loss.backward()
                out["losses"].append(loss.item())
                out["grads"].append([p.grad.to_local().numpy().copy() for p in model.parameters()])
                opt.step()
                del loss
                out["peaks"].append(meter.reset_window())
                out["gathers"].append(dict(counts))
        finally:
            if sm is not None:
                sm.__exit__(None, None, None)
    if sm is not None:
        r = sm.report()
        result = sm.joint_view.result
        best = result.best if result is not None else None
        out["plan"] = best.strategy.plan if best is not None and best.feasible else None
        out["reruns"] = {m["module"]: m["reruns"] for m in r["modules"]}
        out["not_checkpointed"] = r["not_checkpointed"]
        out["notes"] = list(r.get("notes", []))
    return out
