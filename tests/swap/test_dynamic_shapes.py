"""Batches whose shape changes (a padding collator's sequence lengths): a shape seen before, or smaller than one
seen, runs on a kept plan without profiling (Note [Plans by input shape] in swap.runtime.activations.plan_book), bitwise
equal to training without the manager and within the budget every iteration. The window policy: the joint
strategy's choice of recompute regions depends on measured times, and a new choice profiles again.
bench/dynamic_shapes.py measures the default strategy."""

from __future__ import annotations

import functools

import torch
from training import KiB, assert_bitwise_equal, assert_within, run

import swap
from swap.forecast import zoo as models
from swap.runtime.activations.plan_book import Entry, PlanBook

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


def test_the_plan_book_finds_its_own_then_the_nearest_larger_shape():
    book, entry = PlanBook(limit=3), Entry(None, None, 0)
    book.keep(("torch.int64", (8, 64)), entry)
    book.keep(("torch.int64", (8, 128)), Entry(None, None, 1))
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
