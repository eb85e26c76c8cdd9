"""Issue 35 item 6: an optimizer over only some trainable parameters, with model state, made the joint search
raise "variable 0 is read in the backward but no longer saved: inconsistent op table" from
swap/joint/regions.py once a plan was needed. The streamed buckets of weights are clean variables (Note [Clean
variables]): used, never saved, numbered first. The region rewrite numbered variables by their saves alone, so
a bucket had no number. Whether the search got there depended on which buckets the placement streamed (timing),
so this checks the rewrite itself, on the block chain tests/plan uses, with a bucket of weights in front."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from swap.joint.ops import OpTable
from swap.joint.regions import RecomputePlan, Region, apply_regions
from swap.schedule.sequence import USE, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plan"))
from test_joint_planning import blocks  # noqa: E402


def with_a_bucket_of_weights(seq: Sequence, table: OpTable, nbytes: int = 500) -> tuple[Sequence, OpTable]:
    """``seq`` with a clean variable 0 (a bucket of weights) used before the forward and before the backward."""
    n, half = len(seq), seq.kind.index(USE)

    def var(v: int) -> int:
        return v + 1 if v >= 0 else v

    def step(i: int) -> int:
        return i + 1 if i < half else i + 2

    def spliced(values: list, first, second) -> list:
        return [first] + values[:half] + [second] + values[half:]

    out = Sequence(
        spliced([var(v) for v in seq.var], 0, 0), spliced(seq.kind, USE, USE), [nbytes] + seq.sizes,
        spliced(seq.nonswap, seq.nonswap[0], seq.nonswap[half]), spliced(seq.compute, 0.0, 0.0),
        held_until=[0] + [step(h) if h < n else n + 2 for h in seq.held_until],
        transient=spliced(seq.transient, 0, 0), modules=["weights"] + seq.modules,
        clean=[True] + [False] * len(seq.sizes),
    )  # fmt: skip
    ops = [replace(o, step=step(o.step), outputs=tuple(map(var, o.outputs)), inputs=tuple(map(var, o.inputs)))
           for o in table.ops]  # fmt: skip
    calls = [replace(c, steps=(step(c.steps[0]), step(c.steps[1])), inputs=tuple((var(v), b) for v, b in c.inputs))
             for c in table.calls]  # fmt: skip
    return out, OpTable(ops, calls)


@pytest.mark.parametrize("paths", [(), ("layers.0",), ("layers.0", "layers.1")])
def test_regions_rewrite_a_sequence_with_a_bucket_of_weights(paths):
    seq, table = with_a_bucket_of_weights(*blocks(2, 3, [1000, 2000, 3000], [0.01, 0.02, 0.03]))
    out = apply_regions(seq, table, RecomputePlan(tuple(Region(p) for p in paths))).sequence
    # The bucket keeps its number and stays clean, used where it was: before the forward and the backward.
    assert out.clean[0] and not any(out.clean[1:])
    assert out.sizes[0] == 500 and [i for i, v in enumerate(out.var) if v == 0][0] == 0
    assert sum(1 for v, k in zip(out.var, out.kind) if v == 0 and k == USE) == 2
