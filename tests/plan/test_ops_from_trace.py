"""The operator table from a captured trace (swap.forecast.ops_from_trace) against the one the runtime's operator
profiler records from a real run of the same model: same regions, same saved variables per operator."""

import numpy as np
import pytest
import torch

import swap
from swap.capture import OP, UNREF, capture
from swap.devices import profile
from swap.forecast import zoo
from swap.forecast.from_trace import sequence_from_trace
from swap.forecast.ops_from_trace import table_from_trace
from swap.joint.search import Evaluator, checkpoint, search

MIN_BYTES = 16 * 1024
BATCH = 8


def small_gpt() -> torch.nn.Module:
    return zoo.gpt(n_layer=2, n_head=4, d_model=64, vocab=256, seq_len=64)


def batch_fn(n: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, 64), generator=g)
    return x, torch.randint(0, 256, (n, 64), generator=g)


def loss_fn(model, batch):
    x, y = batch
    return zoo.loss_fn(model, model(x), y)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def runtime_profile(iterations: int = 4, model_fn=small_gpt, batches=batch_fn, loss=loss_fn, budget="3500KiB"):
    """The runtime's sequence and operator table of ``model_fn()`` (strategy "auto" under a budget that needs it)."""
    torch.manual_seed(0)
    model = model_fn()
    opt = sgd(model.parameters())
    seen = {}

    def choose(ev):
        seen["ev"] = ev
        return search(ev)

    sm = swap.SwapManager(budget=budget, device="cpu", min_bytes=MIN_BYTES)
    sm._joint.choose = choose
    with sm:
        for _ in range(iterations):
            opt.zero_grad(set_to_none=True)
            loss(model, batches(BATCH)).backward()
            opt.step()
    return seen["ev"]


def is_view(name: str) -> bool:
    _, packet, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, packet), overload).is_view


@pytest.fixture(scope="module")
def both():
    ev = runtime_profile()
    trace = capture(small_gpt, batch_fn, BATCH, loss_fn, optimizer=sgd, target="cpu")
    seq = sequence_from_trace(trace, min_bytes=MIN_BYTES)
    return ev, seq, table_from_trace(trace, profile("h100-sxm"), min_bytes=MIN_BYTES)


def test_the_trace_table_has_the_runtime_profilers_regions_and_saved_variables(both):
    ev, seq, table = both
    assert (seq.var, seq.kind, seq.sizes) == (ev.seq.var, ev.seq.kind, ev.seq.sizes)  # numbered alike
    assert table.levels() == ev.table.levels() == {"blocks.*": ["blocks.0", "blocks.1"]}
    runtime_calls = {c.path: (c.steps, c.inputs, c.blocker) for c in ev.table.calls}
    assert {c.path: (c.steps, c.inputs, c.blocker) for c in table.calls} == runtime_calls
    # Per operator (the trace leaves out views, which move nothing, and counts the loss gradient's seed in the
    # backward): name, module, the variables its outputs are, its step, and, where an output is saved (what a
    # plan may keep), whether it can be kept.
    runtime_ops = [op for op in ev.table.ops if not is_view(op.name)]
    assert [op.name for op in runtime_ops[len(table.ops) :]] == ["aten.ones_like.default"]

    def row(op):
        saved = tuple(v for v in op.outputs if v >= 0)
        return op.name, op.module, saved, op.step, op.keepable if saved else None

    assert [row(op) for op in table.ops] == [row(op) for op in runtime_ops[: len(table.ops)]]
    gelu = [op for op in table.ops if op.name == "aten.gelu.default"]
    assert [op.inputs for op in gelu] == [tuple(v for v in op.inputs if v >= 0)
                                          for op in runtime_ops if op.name == "aten.gelu.default"]  # fmt: skip


def test_the_trace_table_prices_operators_on_the_roofline_and_plans_like_the_runtimes(both):
    ev, seq, table = both
    h100 = profile("h100-sxm")
    for op in table.ops:
        assert op.seconds == pytest.approx(h100.step_seconds(op.flops, op.nbytes, False))
    # The same plan (full checkpointing of both blocks) from either table; the rerun costs what the block's
    # operators cost, on either clock.
    budget = int(0.7 * ev.seq.no_swap_peak())
    ours = checkpoint(Evaluator(seq, table, budget, 1e9, 1e9))
    theirs = checkpoint(Evaluator(ev.seq, ev.table, budget, 1e9, 1e9))
    assert ours.feasible and theirs.feasible
    assert ours.strategy.plan.paths == theirs.strategy.plan.paths == ["blocks.0", "blocks.1"]
    assert ours.sequence.var == theirs.sequence.var and ours.model.recomputed_bytes == theirs.model.recomputed_bytes
    assert ours.peak == pytest.approx(theirs.peak, rel=0.05)  # the capture's memory, not the allocator's
    block = [op for op in table.ops if op.module.startswith("blocks.")]
    assert 0 < ours.recompute_seconds <= sum(op.seconds for op in block)


class Activations(torch.nn.Module):
    """Blocks that end in activations whose autograd nodes save their input (ELU, ReLU6, LeakyReLU) or their
    output (Tanh, in-place LeakyReLU): the saves after a block's last operator are its own or the next block's
    input (Note [Operators that save their output])."""

    ENDS = (torch.nn.ELU, torch.nn.ReLU6, torch.nn.LeakyReLU, torch.nn.Tanh, lambda: torch.nn.LeakyReLU(inplace=True))

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, d)  # a token input: the trace does not count the batch as saved
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d), end())
            for end in self.ENDS
        )
        self.head = torch.nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def activations_batch(n: int):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 64), generator=g), torch.randint(0, 8, (n, 64), generator=g)


def activations_loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def test_blocks_ending_in_activations_that_save_their_input_have_the_runtimes_inputs():
    ev = runtime_profile(model_fn=Activations, batches=activations_batch, loss=activations_loss, budget="5MiB")
    trace = capture(Activations, activations_batch, BATCH, activations_loss, optimizer=sgd, target="cpu")
    table = table_from_trace(trace, min_bytes=MIN_BYTES)
    paths = [f"blocks.{i}" for i in range(len(Activations.ENDS))]
    assert table.levels()["blocks.*"] == ev.table.levels()["blocks.*"] == paths
    # The blocks: the same steps, inputs and blockers. (Single layers are left out: the trace does not see an
    # input no operator saves, such as Tanh's, which saves its output only.)
    runtime_calls = {c.path: (c.steps, c.inputs, c.blocker) for c in ev.table.calls if c.path in paths}
    assert {c.path: (c.steps, c.inputs, c.blocker) for c in table.calls if c.path in paths} == runtime_calls
    # Each block reads one input of 128 KiB, its predecessor's output, whatever its last activation saves.
    assert all(len(runtime_calls[p][1]) == 1 and runtime_calls[p][1][0][1] == 128 * 1024 for p in paths)
    runtime_ops = [op for op in ev.table.ops if not is_view(op.name)]

    def row(op):  # an in-place operator allocates nothing: the trace gives it no outputs, the profiler what it wrote
        saved = () if op.name.endswith("_.default") else tuple(v for v in op.outputs if v >= 0)
        return op.name, op.module, saved, op.step

    assert [row(op) for op in table.ops] == [row(op) for op in runtime_ops[: len(table.ops)]]


def test_in_place_writes_block_their_module_and_unsaved_outputs_are_not_kept():
    from tiny_models import TinyCNN, cnn_batch

    class Inplace(TinyCNN):
        def __init__(self) -> None:
            super().__init__()
            self.body[2].inplace = self.body[5].inplace = True  # ReLU(inplace=True), as torchvision's ResNets

    trace = capture(Inplace, cnn_batch, 4, target="cpu")
    table = table_from_trace(trace, min_bytes=0)
    assert "body.*" in table.levels()
    assert "relu_" in table.blocked("body.2") and "in place" in table.blocked("body.2")
    assert table.blocked("body.0") == ""
    norms = [op for op in table.ops if "batch_norm" in op.name]
    assert norms and not any(op.keepable for op in norms)  # relu_ writes their outputs afterwards


def test_a_trace_without_operator_events_is_refused_with_what_to_do():
    trace = capture(small_gpt, batch_fn, 2, loss_fn, target="cpu")
    trace.op = np.where(trace.op == OP, UNREF, trace.op).astype(np.uint8)  # no operator events, as in format 5
    with pytest.raises(ValueError, match="capture it again"):
        table_from_trace(trace)
