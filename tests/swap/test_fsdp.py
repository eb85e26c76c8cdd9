"""SwapManager(strategy="auto") under FSDP2 (``fully_shard`` per block) on two CPU ranks (gloo): bitwise equal to
the same FSDP2 training without the manager, each rank within its own budget, region reruns that never
all-gather again, and ranks that agree on what they recompute (Note [Ranks agree on a plan])."""

import math
import sys
from pathlib import Path

import numpy as np
import pytest

import swap
from swap.joint.regions import RecomputePlan, Region
from swap.joint.search import Outcome, Strategy, search
from swap.runtime.auto.ranks import agree

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_ranks import spawn, train  # noqa: E402

SLOW_LINK = 1e6  # bytes/s: on this rank copies cost more than recomputing, so its own plan checkpoints blocks
BUDGET = {0: 0.7, 1: 0.6}  # of each rank's own plain peak: the ranks plan for different budgets


def _slow_on_rank_1(rank: int):
    def choose(ev):
        if rank == 1:  # ranks that would otherwise diverge: rank 1 measures a slow link
            ev.h2d = ev.d2h = SLOW_LINK
        return search(ev)

    return choose


def _auto(budget: int, choose, group=None):
    def make() -> swap.SwapManager:
        sm = swap.SwapManager(budget=budget, device="cpu", min_bytes=0, group=group)
        sm._joint.choose = choose
        return sm

    return make


def _diverging_ranks(rank: int, tmp: str) -> dict:
    plain = train(rank, None)
    budget = int(max(plain["peaks"]) * BUDGET[rank])
    together = train(rank, _auto(budget, _slow_on_rank_1(rank)))
    alone = train(rank, _auto(budget, _slow_on_rank_1(rank), group=False))
    return {"plain": plain, "together": together, "alone": alone, "budget": budget}


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    for it, (ga, gb) in enumerate(zip(a["grads"], b["grads"], strict=True)):
        for k, (x, y) in enumerate(zip(ga, gb, strict=True)):
            assert np.array_equal(x, y), f"iteration {it}: gradient shard {k} differs"


@pytest.mark.slow
def test_auto_under_fsdp2_is_bitwise_within_each_ranks_budget_reruns_gather_once_and_ranks_agree(tmp_path):
    ranks = spawn(_diverging_ranks, tmp_path)
    for rank, r in enumerate(ranks):
        for run in ("together", "alone"):
            _assert_bitwise(r["plain"], r[run])
            over = [p for p in r[run]["peaks"] if p > r["budget"]]
            assert not over, f"rank {rank} ({run}) over its budget of {r['budget']}: {r[run]['peaks']}"
            # A rerun never repeats a collective: each block all-gathers once in the forward and once in the
            # backward, rerun or not, exactly as without the manager.
            assert r[run]["gathers"] == r["plain"]["gathers"], (rank, run)
        assert r["plain"]["gathers"][-1] == {"root": 1, **{f"blocks.{i}": 2 for i in range(4)}}
    # Planning alone, the ranks' timings lead them to different plans; together, they take one plan, and it
    # reruns blocks (rank 1's link makes swapping the slow choice for it).
    assert ranks[0]["alone"]["plan"] != ranks[1]["alone"]["plan"]
    assert ranks[0]["together"]["plan"] == ranks[1]["together"]["plan"] is not None
    assert any(p.startswith("blocks.") for p in ranks[0]["together"]["plan"].paths)
    for r in ranks:
        assert sum(n for m, n in r["together"]["reruns"].items() if m.startswith("blocks.")) > 0
        assert any("agreed by 2 ranks" in n for n in r["together"]["notes"])


def _nested(rank: int, tmp: str) -> dict:
    plain = train(rank, None, iterations=4, nested=True)
    budget = int(max(plain["peaks"]) * 0.6)
    slow = _auto(budget, lambda ev: (setattr(ev, "h2d", SLOW_LINK), setattr(ev, "d2h", SLOW_LINK), search(ev))[-1])
    return {"plain": plain, "auto": train(rank, slow, iterations=4, nested=True), "budget": budget}


@pytest.mark.slow
def test_a_block_holding_a_nested_fsdp2_module_is_never_rerun(tmp_path):
    """A rerun of a block whose ``fc`` is sharded on its own would all-gather ``fc`` again (FSDP2's forward
    hooks fire inside the rerun), so such a block is never checkpointed; the report says why."""
    for rank, r in enumerate(spawn(_nested, tmp_path)):
        _assert_bitwise(r["plain"], r["auto"])
        assert r["auto"]["gathers"] == r["plain"]["gathers"]
        assert all(p <= r["budget"] for p in r["auto"]["peaks"]), (rank, r["auto"]["peaks"], r["budget"])
        blocked = r["auto"]["not_checkpointed"]
        assert {f"blocks.{i}" for i in range(4)} <= set(blocked), blocked
        assert all("sharded by FSDP2" in blocked[f"blocks.{i}"] for i in range(4)), blocked
        assert not any(n for m, n in r["auto"]["reruns"].items() if m.startswith("blocks."))


# -- the agreement, with the collectives faked ---------------------------------------------------------------
class FakeRanks:
    """Two ranks' answers, this rank being ``rank``: ``others`` is what the other rank proposes and the step
    times it judges each candidate at (by the candidate's plan)."""

    size = 2

    def __init__(self, rank: int, proposes, judges: dict) -> None:
        self.rank, self.proposes, self.judges = rank, proposes, judges
        self.candidates = None

    def gather(self, obj):
        return [obj, self.proposes] if self.rank == 0 else [self.proposes, obj]

    def slowest(self, values):
        return [max(v, self.judges[i]) for i, v in enumerate(values)]


class FakeEvaluator:
    evaluations = 3

    def __init__(self, times: dict) -> None:
        self.times = times

    def evaluate(self, s: Strategy) -> Outcome:
        t = self.times[s.plan]
        return Outcome(s, not math.isinf(t), t)


A = Strategy("auto", RecomputePlan((Region("blocks.0"),)), "window")
B = Strategy("auto", RecomputePlan((), True), "window")


def test_ranks_take_the_candidate_whose_slowest_rank_is_fastest():
    ev = FakeEvaluator({A.plan: 1.0, B.plan: 2.0})  # here A is faster; on the other rank A is much slower
    got = agree(FakeRanks(0, B, {0: 5.0, 1: 2.5}), ev, A)
    assert got.best.strategy == B and got.best.step_time == 2.0  # judged on this rank's own profile


def test_a_candidate_that_does_not_fit_one_rank_is_never_taken_and_none_fitting_means_swap_only():
    ev = FakeEvaluator({A.plan: 1.0, B.plan: math.inf})
    assert agree(FakeRanks(1, B, {0: 1.0, 1: 0.5}), ev, A).best.strategy == A
    assert agree(FakeRanks(1, B, {0: 0.5, 1: math.inf}), ev, A) is None  # candidates: [B, A] in rank order


def test_a_rank_that_would_decline_still_takes_part_and_takes_the_agreed_plan():
    ev = FakeEvaluator({A.plan: 1.0})
    assert agree(FakeRanks(0, A, {0: 1.5}), ev, None).best.strategy == A
    assert agree(FakeRanks(0, None, {}), ev, None) is None  # nobody proposes: every rank declines or swaps


def test_group_must_be_a_process_group():
    with pytest.raises(TypeError, match="ProcessGroup"):
        swap.runtime.auto.ranks.Ranks.of("gloo")
    assert swap.runtime.auto.ranks.Ranks.of(None) is None  # not initialised: each process plans alone
    assert swap.runtime.auto.ranks.Ranks.of(False) is None
