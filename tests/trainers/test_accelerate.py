"""``accelerate.find_executable_batch_size`` with swap and vmalloc: their out-of-memory errors, made torch's by
``swap.integrations.oom.torch_oom``, make it retry with a smaller batch.

What this proves on CPU: accelerate's own test (``should_reduce_batch_size``) accepts the converted errors; a
real vmalloc arena (host backend) running out during a step, and the swap runtime finding no schedule for a
batch under its budget, each lead accelerate to the largest batch that fits; and training at that batch
under swap through ``Accelerator.prepare``/``backward`` is bitwise equal to training without it. What it
cannot prove here: that on a GPU, with vmalloc as PyTorch's allocator, a failed allocation reaches Python as
``torch.OutOfMemoryError`` (the torch-facing adapter's job, tested in tests/gpu)."""

import contextlib

import pytest
import torch
from recipes import assert_bitwise_equal, assert_swapped_within, batch, budget_from_profile, gpt2, manager, params

import swap
import vmalloc
from swap.integrations.oom import torch_oom

accelerate = pytest.importorskip("accelerate")
from accelerate.utils.memory import find_executable_batch_size, should_reduce_batch_size  # noqa: E402

MiB = 1 << 20


def test_converted_errors_are_what_accelerate_reduces_the_batch_on():
    arena = vmalloc.Arena("host", capacity=8 * MiB)
    with pytest.raises(vmalloc.OutOfMemoryError) as raw:
        arena.malloc(16 * MiB)
    assert not should_reduce_batch_size(raw.value)  # as vmalloc raises it, accelerate does not see an OOM
    for original in (raw.value, swap.InfeasibleBudget(3, 200, 100, "a save")):
        with pytest.raises(torch.OutOfMemoryError) as converted:
            with torch_oom():
                raise original
        assert should_reduce_batch_size(converted.value) and converted.value.__cause__ is original
        assert str(converted.value).startswith("CUDA out of memory. ")
    with pytest.raises(KeyError):  # anything else passes through
        with torch_oom():
            raise KeyError("not memory")


def test_a_vmalloc_arena_running_out_reduces_the_batch():
    arena = vmalloc.Arena("host", capacity=64 * MiB)
    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def step(batch_size):
        tried.append(batch_size)
        with torch_oom():
            activations = arena.malloc(batch_size * 2 * MiB)  # the step's activations, 2 MiB per sample
            arena.free(activations)
        return batch_size

    assert step() == 32 and tried == [64, 57, 51, 45, 40, 36, 32]
    assert arena.stats()["allocated_bytes.all.current"] == 0  # state intact after the OOMs


def train(batch_size, sm=None, steps=3):
    accelerator = accelerate.Accelerator(cpu=True)
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    losses = []
    with torch_oom(), sm if sm is not None else contextlib.nullcontext():
        for it in range(steps):
            loss = model(**batch(batch_size, it)).loss
            opt.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            opt.step()
            losses.append(loss.item())
    return losses, params(model)


def test_swap_budgets_reduce_the_batch_and_training_stays_bitwise_equal():
    # A budget a quarter of the way from batch 8's floor to its peak: batch 8 swaps, batch 16 and more have no
    # schedule. The batch halves on each out-of-memory error: 64, 32, 16, 8.
    budget = budget_from_profile(lambda sm: train(8, sm), fraction=0.25)
    managers = {}
    halve = {"n": 64}

    def reduce_batch_size():
        halve["n"] //= 2
        return halve["n"]

    @find_executable_batch_size(starting_batch_size=64, reduce_batch_size_fn=reduce_batch_size)
    def run(batch_size):
        managers[batch_size] = manager(budget)
        return batch_size, train(batch_size, managers[batch_size])

    found, (losses, got) = run()
    assert found == 8 and sorted(managers) == [8, 16, 32, 64]
    ref_losses, ref_params = train(found)
    assert losses == ref_losses
    assert_bitwise_equal(ref_params, got)
    assert_swapped_within(managers[found].report(), budget)
