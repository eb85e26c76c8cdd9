"""The ranks of a process group agreeing on the joint plan (``strategy="auto"`` under DDP or FSDP2).

Note [Ranks agree on a plan]
Under DDP or FSDP2 every rank runs its own manager and plans on its own profile: its own budget, its own
measured operator seconds and link rates. What a rank swaps stays its own business (copies are local), but
what it recomputes does not:
- a rank that recomputes more is the straggler that every collective of the step waits for, and operator
  timings differ between ranks by noise alone (two ranks of one FSDP2 model picked different keep sets in our
  two-rank test);
- a region rerun changes the saved-tensor structure and the step's time on that rank only.
A rerun never repeats a collective: an operator that is a collective is kept (its output handed back at the
rerun), and a module whose forward runs one that writes its output in place (FSDP2's all-gather of a nested
sharded module) is not checkpointed at all (Note [Operators that cannot be rerun] in swap.runtime.auto.op_facts).
A module that FSDP2 shards itself runs its all-gather in its forward pre-hook, outside the wrapped forward the
checkpoint reruns; in the backward its parameters are already all-gathered by FSDP2's pre-backward hook.

So the joint decision is made together, at the last profiling iteration (the same iteration on every rank:
the profiling count depends on the model, not on timings):
1. every rank joins, a rank that would decline too (its candidate is None);
2. ranks exchange their best strategies (one ``all_gather_object``);
3. each rank judges every distinct candidate on its own profile and budget (its simulated step time, infinite
   where it does not fit) and one ``all_reduce(MAX)`` gives each candidate's slowest rank;
4. every rank takes the candidate whose slowest rank is fastest (ties: the lowest rank's), so the plan fits
   every rank's budget and the straggler is as fast as the candidates allow. None fits everywhere: every rank
   swaps only, each on its own schedule.
Both collectives run on the user's process group (the default group unless the manager is given one), on the
device its backend needs (CUDA for NCCL); no process group is created.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ...joint.search import Evaluator, JointResult, Outcome, Strategy


class Ranks:
    """The process group ``group`` whose ranks agree (Note [Ranks agree on a plan])."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        cuda = "nccl" in backend and "gloo" not in backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    @staticmethod
    def of(group: Any) -> Optional[Ranks]:
        """``group=`` of the manager: None for the default group when torch.distributed is initialised with more
        than one rank (else planning alone), False to plan alone, or a process group."""
        if group is False:
            return None
        import torch.distributed as dist

        if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
            raise TypeError(f"group= takes a torch.distributed ProcessGroup, None (the default group) or False "
                            f"(plan alone), not {type(group).__name__}")  # fmt: skip
        if not dist.is_available() or not dist.is_initialized():
            if group is not None:
                raise ValueError("group= names a process group, but torch.distributed is not initialised: call "
                                 "init_process_group first, or leave group=None")  # fmt: skip
            return None
        ranks = Ranks(group)
        return ranks if ranks.size > 1 else None

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order."""
        out: list[Any] = [None] * self.size
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def slowest(self, values: list[float]) -> list[float]:
        """Element-wise maximum over the ranks (every rank passes as many values)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        return t.cpu().tolist()


def agree(ranks: Ranks, ev: Optional[Evaluator], mine: Optional[Strategy]) -> Optional[JointResult]:
    """The strategy every rank takes (Note [Ranks agree on a plan]): ``mine`` is this rank's best (None: it would
    decline, or found none), ``ev`` judges strategies on this rank's profile (None: nothing was profiled, so
    no candidate constrains this rank). Returns the agreed outcome judged here, or None when no rank proposes a
    strategy or none fits every rank."""
    proposed = ranks.gather(mine)
    candidates: list[Strategy] = []
    for s in proposed:
        if s is not None and s not in candidates:
            candidates.append(s)
    if not candidates:
        return None
    mine_judged: list[Optional[Outcome]] = [_judge(ev, s) for s in candidates]
    local = [0.0 if o is None else o.step_time for o in mine_judged]
    slowest = ranks.slowest(local)
    best = min(range(len(candidates)), key=lambda i: (slowest[i], i))
    if math.isinf(slowest[best]):
        return None
    outcome = mine_judged[best]
    if outcome is None:
        return None
    return JointResult(outcome, {}, ev.evaluations if ev is not None else 0)


def _judge(ev: Optional[Evaluator], s: Strategy) -> Optional[Outcome]:
    if ev is None:
        return None
    try:
        return ev.evaluate(s)
    except (KeyError, ValueError):  # a region path this rank's profile does not have
        return Outcome(s, False, math.inf, "not in this rank's profile")
