"""Batches whose shape changes (a padding collator's sequence lengths): a shape seen before, or smaller than one
seen, runs on a kept plan without profiling (Note [Plans by input shape] in swap.runtime.activations.plan_book), bitwise
equal to training without the manager and within the budget every iteration. The window policy: the joint
strategy's choice of recompute regions depends on measured times, and a new choice profiles again.
bench/dynamic_shapes.py measures the default strategy."""

from __future__ import annotations

import functools
import gc
import sys
import warnings
from pathlib import Path

import torch
from training import KiB, assert_bitwise_equal, assert_within, run

import swap
from swap.forecast import zoo as models
from swap.runtime.activations.plan_book import Entry, PlanBook
from swap.schedule.sequence import SAVE, USE, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_meter import SweepMeter  # noqa: E402

ROUND = [48, 64, 32, 56]  # sequence lengths, cycled


def lengths_batch(lengths: list[int]):  # noqa: ANN201 - a batch_fn for training.run
    def batch(model: torch.nn.Module, it: int) -> tuple[torch.Tensor, torch.Tensor]:
        return models.example_batch(model, 8, lengths[it], torch.Generator().manual_seed(it))

    return batch


def manager(budget: int) -> swap.SwapManager:
    return swap.SwapManager(budget=budget, device="cpu", policy="window", min_bytes=16 * KiB)


def train(lengths: list[int], budget: int = 0) -> dict:
    """Trains the small GPT at ``lengths``, under a manager with ``budget`` (0: none), metered."""
    return run("gpt", len(lengths), manager=(lambda: manager(budget)) if budget else None,
               meter=swap.LiveBytesMeter("cpu"), batch_fn=lengths_batch(lengths))  # fmt: skip


@functools.cache
def budget() -> int:
    """A third of the way from the longest length's smallest budget to its peak without swapping: the shorter
    lengths fit it unswapped or nearly."""
    probe = run("gpt", 3, manager=lambda: swap.SwapManager(budget="64GiB", device="cpu", min_bytes=16 * KiB),
                batch_fn=lengths_batch([64] * 3))  # fmt: skip
    floor = swap.schedule.budget.min_budget(probe["manager"].sequence)
    peak = max(train([64] * 3)["peaks"])
    return floor + (peak - floor) // 3


def test_cycling_shapes_profiles_only_in_the_first_round():
    """Before plans were kept by shape, every change of length fell back and profiled again: the run never
    stopped profiling and re-planned at almost every iteration."""
    lengths = ROUND * 3
    b = budget()
    got = train(lengths, b)
    assert_bitwise_equal(train(lengths), got)
    assert_within(got["peaks"], b)
    r = got["manager"].report()
    # The first plan profiles two iterations (48, then 64: Note [Two profiling iterations]) and is 64's; the
    # shorter lengths run on it, and every later iteration on a kept plan.
    assert r["profiling_iterations"] == 2, r
    assert r["replans"] == 0 and r["overruns"] == 0 and r["status"] == "planned", r
    assert r["shapes_seen"] == 4 and r["plans_derived"] == 3
    assert r["plans_refined"] == 3  # each derived plan planned again on its own shape's sizes, no profiling
    assert r["plans_reused"] == len(lengths) - 2


def test_profiling_stops_growing_after_the_first_round():
    b = budget()
    counts = []
    sm = manager(b)
    torch.manual_seed(0)
    model = models.gpt(n_layer=2, n_head=4, d_model=64, vocab=256, seq_len=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batch = lengths_batch(ROUND[::-1] * 3)  # 56 first: 64 is then profiled, and 48 and 32 derive
    with sm:
        for it in range(len(ROUND) * 3):
            x, y = batch(model, it)
            models.loss_fn(model, model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if it % len(ROUND) == len(ROUND) - 1:
                counts.append(sm.report()["profiling_iterations"])
    assert counts[0] == counts[1] == counts[2] <= 3, counts


def test_a_shape_that_fits_declines_alone():
    """A run declined at a short length that fits the budget used to stay declined for every length, and the
    first long one went over the budget before the manager noticed."""
    lengths = [32, 32, 64, 32, 64, 64]
    b = budget()
    assert max(train([32] * 3)["peaks"]) <= b < max(train([64] * 3)["peaks"])
    got = train(lengths, b)
    assert_bitwise_equal(train(lengths), got)
    assert_within(got["peaks"], b)
    r = got["manager"].report()
    assert r["profiling_iterations"] == 3 and r["status"] == "planned" and r["overruns"] == 0, r


def planned_entry(first_live: int = 0) -> Entry:
    """A kept plan (not a declined run): one variable saved and used."""
    seq = Sequence([0, 0], [SAVE, USE], [8 * KiB], [KiB, KiB], [1e-3, 1e-3])
    return Entry(seq, swap.make_schedule(seq, 16 * KiB, policy="all"), first_live)


def test_the_plan_book_finds_its_own_then_the_nearest_larger_shape():
    book, entry = PlanBook(limit=3), planned_entry()
    book.keep(("torch.int64", (8, 64)), entry)
    book.keep(("torch.int64", (8, 128)), planned_entry(1))
    assert book.find(("torch.int64", (8, 64))) == (entry, None)  # its own
    assert book.find(("torch.int64", (8, 48))) == (entry, ("torch.int64", (8, 64)))  # the nearest larger
    assert book.find(("torch.int64", (8, 16))) == (None, None)  # a quarter of 64: profiled on its own
    assert book.find(("torch.int64", (16, 48))) == (None, None)  # no kept shape covers a larger batch
    assert book.find(("torch.float32", (8, 48))) == (None, None)  # nor another dtype
    book.reject(("torch.int64", (8, 48)), derived=True)  # its derived plan did not match its steps
    assert book.find(("torch.int64", (8, 48))) == (None, None)
    for n in (1, 2, 3):
        book.keep(("torch.int64", (n,)), entry)
    assert len(book.entries) == 3 and ("torch.int64", (8, 64)) not in book.entries  # least recently used


def test_a_declined_shape_serves_every_smaller_one():
    """A run that fit the budget unswapped at a shape fits it at any smaller one: no bounds to overstate, so no
    ratio limit, and the nearest larger entry still wins over a farther plan."""
    book, declined = PlanBook(), Entry(None, None, 0)
    book.keep(("torch.int64", (8, 128)), planned_entry())
    assert book.find(("torch.int64", (8, 16))) == (None, None)  # an eighth of a plan's shape: profiled
    book.keep(("torch.int64", (8, 40)), declined)
    assert book.find(("torch.int64", (8, 8))) == (declined, ("torch.int64", (8, 40)))
    assert book.find(("torch.int64", (8, 72)))[0] is book.entries[("torch.int64", (8, 128))]  # a longer one: the plan


# A one-layer GPT at batch 32 and the default min_bytes (1 MiB): at length 64 its attention scores and q/k/v are
# saved as 2 and 1.5 MiB tensors, at 40 and below as less than 1 MiB, so shorter lengths save fewer tensors of
# min_bytes than the plan they borrow has (Note [A plan's variables, whatever their size]).
DEFAULT_BATCH = 32
CROSSING = [64, 64, 40, 56, 32, 40, 56, 32]


def one_layer() -> torch.nn.Module:
    return models.gpt(n_layer=1, n_head=4, d_model=64, vocab=256, seq_len=64)


def default_batch(lengths: list[int]):  # noqa: ANN201 - a batch_fn for training.run
    def batch(model: torch.nn.Module, it: int) -> tuple[torch.Tensor, torch.Tensor]:
        return models.example_batch(model, DEFAULT_BATCH, lengths[it], torch.Generator().manual_seed(it))

    return batch


def test_default_settings_keep_one_plan_across_lengths_within_the_budget():
    """Default min_bytes and strategy. Tensors that cross min_bytes between lengths used to shift a derived plan's
    steps: each shorter length diverged (a re-plan), profiled on its own, and shorter ones declined or derived
    anew, so the run kept profiling. Now the first plan serves every length, each refined once on its own sizes
    at its first appearance, and no iteration exceeds the budget by an independent meter that re-reads every
    storage at each operator (the sweep meter; nothing warns either)."""
    floor_run = run("gpt", 3, manager=lambda: swap.SwapManager(budget="64GiB", device="cpu"), build=one_layer,
                    batch_fn=default_batch([64] * 3))  # fmt: skip
    floor = swap.schedule.budget.min_budget(floor_run["manager"].sequence)
    plain = run("gpt", len(CROSSING), meter=swap.LiveBytesMeter("cpu"), build=one_layer,
                batch_fn=default_batch(CROSSING))  # fmt: skip
    b = floor + (max(plain["peaks"]) - floor) // 3
    gc.collect()
    sweep = SweepMeter().track_existing()
    now = swap.LiveBytesMeter()
    with now.track_existing():  # storages earlier tests keep that only the sweep finds: not the training's
        unseen = max(0, sweep.sweep() - now.live)
    with warnings.catch_warnings():
        warnings.simplefilter("error", swap.BudgetWarning)
        got = run("gpt", len(CROSSING), manager=lambda: swap.SwapManager(budget=b, device="cpu"), meter=sweep,
                  build=one_layer, batch_fn=default_batch(CROSSING))  # fmt: skip
    assert_bitwise_equal(plain, got)
    assert_within([p - unseen for p in got["peaks"]], b)
    r = got["manager"].report()
    firsts = {n: CROSSING.index(n) for n in CROSSING}
    assert r["replans"] == 0 and r["overruns"] == 0 and r["status"] == "planned", r
    assert r["plan_events"] == [(0, "profile"), (1, "profile")] + [
        (firsts[n] + 1, "refine") for n in sorted(set(CROSSING) - {64}, key=firsts.get)], r  # fmt: skip
