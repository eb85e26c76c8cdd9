"""Weights in the variable sequence: an activation sequence with a model-state plan's streamed buckets added as
clean variables, and the plan's other device bytes added to what is not swappable.

Note [Weights in the sequence]
A bucket's weights are read where its modules' operators run: in the forward, in the backward (and in a
rerun). ``BucketUses`` names those steps of the activation sequence: step j when an operator of the bucket
runs in step j's compute. ``with_weights`` inserts, after each such step j, one step per streamed bucket read
there: a use of the bucket's clean variable (Note [Clean variables] in swap/schedule/sequence.py), with no
compute of its own but the last, which takes step j's compute. The scheduler then keeps every one of them on
the device for that compute: they are one group, held together like the saved tensors a backward node
unpacked (``node_last`` of the group is its last step), and the window fetches them ahead like any other use.

Every other device byte of model state is not ours to move, so it joins ``nonswap`` (Note [Model-state bytes]
in ``ledger``): resident buckets' weights, masters and state at every step and their
gradients from their first backward step on; host masters' compute copies at every step; offloaded buckets'
gradients while their backward makes them (first to final step), then the gradients not yet copied out,
bounded by ``in_flight`` of the largest from the first offloaded gradient on (the simulator holds the bound:
``sim``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import Optional

from ..sequence import SAVE, USE, Sequence
from .ledger import device_bytes_of
from .plan import Bucket, ModelStatePlan, Placement


@dataclass(frozen=True)
class BucketUses:
    """Where a bucket's weights are read (Note [Weights in the sequence]): steps of the activation sequence,
    ascending. A bucket the backward never reads has no gradient (a frozen or unused parameter)."""

    forward: tuple[int, ...]
    backward: tuple[int, ...] = ()

    @property
    def has_grad(self) -> bool:
        return bool(self.backward)

    @property
    def grad_first(self) -> int:
        """The first step whose compute makes part of its gradient."""
        return min(self.backward)

    @property
    def grad_final(self) -> int:
        """The step whose compute finishes its gradient (its last backward read)."""
        return max(self.backward)


@dataclass
class Weighted:
    """``with_weights``'s result.

    Attributes:
        seq: the sequence with the streamed buckets' uses inserted.
        holds: per step the uses name (of the activation sequence, or of the one it was made from), the step
            of ``seq`` that runs its compute.
        var_of: bucket index -> its clean variable in ``seq`` (streamed buckets only).
        model_bytes: per step of ``seq``, the model-state bytes added to ``nonswap``.
        runs: per step of ``seq``, the steps the uses name whose compute it runs, in order (-1: none named);
            ``seconds``: how much of its compute each takes.
    """

    seq: Sequence
    holds: list[int]
    var_of: dict[int, int]
    model_bytes: list[int]
    runs: list[list[int]] = field(default_factory=list)
    seconds: list[list[float]] = field(default_factory=list)

    def step_of(self, step: int) -> int:
        """The step of ``seq`` that runs the compute of step ``step`` (as the uses name steps)."""
        return self.holds[step]


def model_state_bytes(n: int, buckets: Seq[Bucket], uses: Seq[BucketUses], plan: ModelStatePlan,
                      in_flight: int = 2) -> list[int]:  # fmt: skip
    """Per step of an ``n``-step activation sequence, the device bytes of model state that no schedule moves
    (Note [Weights in the sequence])."""
    delta = [0] * (n + 1)

    def add(a: int, b: int, nbytes: int) -> None:
        a, b = max(0, min(a, n)), max(0, min(b, n))
        if a < b and nbytes:
            delta[a] += nbytes
            delta[b] -= nbytes

    outstanding, since = 0, n
    for b, u, p in zip(buckets, uses, plan.placements):
        if p == Placement.RESIDENT:
            add(0, n, device_bytes_of(b, p) - b.grad_bytes)
            if u.has_grad:
                add(u.grad_first, n, b.grad_bytes)
        elif p == Placement.HOST_MASTER:
            add(0, n, b.weight_bytes)
        if p != Placement.RESIDENT and u.has_grad:
            add(u.grad_first, u.grad_final + 1, b.grad_bytes)
            outstanding = max(outstanding, b.grad_bytes)
            since = min(since, u.grad_final + 1)
    add(since, n, in_flight * outstanding)
    out, cur = [], 0
    for i in range(n):
        cur += delta[i]
        out.append(cur)
    return out


def reserve(buckets: Seq[Bucket], uses: Seq[BucketUses], plan: ModelStatePlan, in_flight: int = 2,
            fetch_bytes: Optional[Seq[int]] = None) -> int:  # fmt: skip
    """The device bytes to keep beside the activations at every step so that ``with_weights``' sequence fits
    wherever the activations alone did: the most, over the steps the uses name, of the model-state bytes no
    schedule moves (``model_state_bytes``) and the streamed buckets read in that step's compute, with
    ``in_flight - 1`` of the largest streamed bucket arriving for the next."""
    n = max((max(u.forward + u.backward, default=-1) for u in uses), default=-1) + 1
    fixed = model_state_bytes(n, buckets, uses, plan, in_flight)
    read = [0] * n
    largest = 0
    for k, (u, p) in enumerate(zip(uses, plan.placements)):
        if p == Placement.STREAMED:
            size = fetch_bytes[k] if fetch_bytes is not None else buckets[k].weight_bytes
            largest = max(largest, size)
            for s in set(u.forward) | set(u.backward):
                read[s] += size
    return max((f + r for f, r in zip(fixed, read)), default=0) + (in_flight - 1) * largest


def with_weights(seq: Sequence, buckets: Seq[Bucket], uses: Seq[BucketUses], plan: ModelStatePlan,
                 in_flight: int = 2, fetch_bytes: Optional[Seq[int]] = None, holds: Optional[Seq[int]] = None,
                 compute: Optional[Seq[float]] = None) -> Weighted:  # fmt: skip
    """``seq`` (activations only, its ``nonswap`` without model state) with ``plan``'s model state (Note
    [Weights in the sequence]). ``fetch_bytes``: per bucket, the device bytes of a streamed copy (default its
    ``weight_bytes``; a master fetched to be cast on the device is larger).

    ``uses`` may name the steps of the sequence ``seq`` was made from by a recompute plan (``holds``: each of
    those steps' step in ``seq``, as ``RegionModel.holds`` gives it; ``compute``: their seconds). Where several
    of them run in one step of ``seq`` (the forward of a checkpointed block), that step's compute is split
    between them in proportion to their seconds (``Weighted.runs``), each one's streamed buckets are a group
    of their own in its part, and each part holds the model-state bytes of the steps it runs: a block's
    weights are still read, and its gradients made and copied out, one operator after another."""
    if not (len(buckets) == len(uses) == len(plan.placements)):
        raise ValueError(f"{len(buckets)} buckets, {len(uses)} uses and {len(plan.placements)} placements: give "
                         "one of each per bucket")  # fmt: skip
    n = len(seq)
    holds = list(range(n)) if holds is None else list(holds)
    before = list(seq.compute) if compute is None else list(compute)
    if len(before) != len(holds) or any(not 0 <= h < n for h in holds):
        raise ValueError(f"holds must map each of {len(before)} steps to a step of the sequence's {n}")
    for b, u in zip(buckets, uses):
        if any(not 0 <= s < len(holds) for s in u.forward + u.backward):
            raise ValueError(f"bucket {b.index} is read at a step outside the {len(holds)} steps")
    extra = model_state_bytes(len(holds), buckets, uses, plan, in_flight)  # per step the uses name
    at: list[list[int]] = [[] for _ in holds]  # such a step -> streamed buckets read in its compute
    var_of: dict[int, int] = {}
    for k, (u, p) in enumerate(zip(uses, plan.placements)):
        steps = sorted(set(u.forward) | set(u.backward))
        if p != Placement.STREAMED or not steps:
            continue
        var_of[k] = len(seq.sizes) + len(var_of)
        for s in steps:
            at[s].append(k)
    parts: list[list[int]] = [[] for _ in range(n)]  # step of seq -> the steps it runs
    for j, h in enumerate(holds):
        parts[h].append(j)
    # per new step: var, kind, step of seq, group end (None: the step's own), model-state bytes, runs
    rows: list[list] = []
    first, last = [0] * (n + 1), [0] * n
    piece = [0] * len(holds)  # step the uses name -> the new step running its compute
    for h in range(n):
        first[h] = len(rows)
        opening = extra[parts[h][0]] if parts[h] else 0
        rows.append([seq.var[h], seq.kind[h], h, None, opening, []])
        total = sum(before[j] for j in parts[h])
        for j in parts[h]:
            if at[j]:
                start = len(rows)
                rows += [[var_of[k], USE, h, start + len(at[j]) - 1, extra[j], []] for k in at[j]]
            share = seq.compute[h] * before[j] / total if total > 0 else 0.0
            rows[-1][5].append((j, share))
            rows[-1][4] = max(rows[-1][4], extra[j])
            piece[j] = len(rows) - 1
        if total <= 0:
            rows[-1][5].append((parts[h][-1] if parts[h] else -1, seq.compute[h]))
        last[h] = len(rows) - 1
    first[n] = m = len(rows)
    node_last = [last[seq.node_last[r[2]]] if r[3] is None else r[3] for r in rows]
    added = list(var_of)
    sizes = list(seq.sizes) + [fetch_bytes[k] if fetch_bytes is not None else buckets[k].weight_bytes for k in added]
    modules = (list(seq.modules) if seq.modules else [""] * len(seq.sizes)) + [
        buckets[k].params[0].rsplit(".", 1)[0] if buckets[k].params else "" for k in added
    ]
    out = replace(
        seq, var=[r[0] for r in rows], kind=[r[1] for r in rows], sizes=sizes,
        compute=[sum(sec for _j, sec in r[5]) for r in rows], nonswap=[seq.nonswap[r[2]] + r[4] for r in rows],
        transient=[seq.transient[r[2]] for r in rows], kept=[seq.kept[r[2]] for r in rows], node_last=node_last,
        swappable=list(seq.swappable) + [True] * len(added),
        held_until=[first[h] if h else 0 for h in seq.held_until] + [0] * len(added),
        freed=([first[f] for f in seq.freed] + [m] * len(added)) if seq.freed else [],
        modules=modules, clean=list(seq.clean) + [True] * len(added),
    )  # fmt: skip
    return Weighted(out, piece, var_of, [r[4] for r in rows], [[j for j, _s in r[5]] for r in rows],
                    [[sec for _j, sec in r[5]] for r in rows])  # fmt: skip


# Note [Weights out of a profile]
# A profiled iteration of the runtime has its streamed buckets in it already, as clean variables (Note [Clean
# variables at run time] in swap.runtime.activations.executor): one per bucket, numbered in bucket order, each
# step a use of one where its weights were read. ``without_weights`` takes them out again, so the chooser can
# place any plan in the activations (``with_weights``): a use joins the activation step before it (its compute
# is that step's, as ``with_weights`` puts it back: after the step's access, before its compute), or the first
# step when none came before. A use after the backward's first unpack is the backward's, one before the
# forward's last save the forward's; between the two (the backward may read the last layer's weights before
# the first saved tensor it unpacks, the forward reads the last layer's before it saves) it is the backward's
# when the forward read the bucket already.
# A profile without an activation step (every saved tensor under ``min_bytes``) gets an empty variable saved
# before each of its steps (``stand_in``): the uses keep their order and their compute, and with no unpack to
# tell the passes apart, the backward begins at the first bucket read again other than straight after its last
# read (the backward runs the layers in reverse).
# A bucket the backward never reads may still get a gradient (the first layer's: the weight's gradient needs
# only the saved input when the input needs none; the last layer's, read once across the turn); given the
# buckets, one with gradient bytes and no backward use has it made where the backward unpacks what its modules
# saved, else at the backward step that mirrors its last forward use (the backward runs the forward in reverse).
# What a merged step held (``nonswap``, ``transient``, ``kept``) is the most of its parts. The profile's
# ``nonswap`` holds the streamed buckets' gradients while they were made: with them added again the room errs
# small.
def stand_in(seq: Sequence) -> Sequence:
    """``seq`` with an empty variable saved before each of its steps (Note [Weights out of a profile]): a profile
    that recorded no activation (each under ``min_bytes``) still has steps to place its buckets in."""
    dummy, rows, seen = len(seq.sizes), [], set()
    turn = len(seq)  # the backward's first step: the first bucket read again, not straight after its last read
    for i, v in enumerate(seq.var):
        if v in seen and seq.var[i - 1] != v:
            turn = i
            break
        seen.add(v)
    for i, v in enumerate(seq.var):
        rows += [(dummy, SAVE if i < turn else USE, 0.0, i), (v, seq.kind[i], seq.compute[i], i)]
    at = [2 * i for i in range(len(seq))] + [2 * len(seq)]  # old step -> new (its stand-in's)
    return replace(
        seq, var=[r[0] for r in rows], kind=[r[1] for r in rows], sizes=[*seq.sizes, 0],
        nonswap=[seq.nonswap[r[3]] for r in rows], compute=[r[2] for r in rows],
        swappable=[*seq.swappable, False], held_until=[at[h] for h in seq.held_until] + [0],
        freed=[at[f] for f in seq.freed] + [len(rows)] if seq.freed else [],
        modules=[*seq.modules, ""] if seq.modules else [], transient=[seq.transient[r[3]] for r in rows],
        kept=[seq.kept[r[3]] for r in rows], node_last=list(range(len(rows))), clean=[*seq.clean, False],
        saved_before=[seq.saved_before[r[3]] for r in rows] if seq.saved_before else [],
    )  # fmt: skip


def without_weights(seq: Sequence, buckets: Optional[Seq[Bucket]] = None) -> tuple[Sequence, list[BucketUses]]:
    """``seq`` (a profiled iteration with its buckets as clean variables) as ``with_weights`` takes it: the
    activations alone, and each clean variable's uses in their steps, in variable order (Note [Weights out of a
    profile]); ``buckets`` (one per clean variable): where a gradient the backward made without reading its
    bucket is. Raises ``ValueError`` for a sequence with no clean variable or no activation step."""
    clean = [v for v, c in enumerate(seq.clean) if c]
    if not clean:
        raise ValueError("the sequence has no clean variable (no streamed bucket was profiled)")
    keep = [i for i, v in enumerate(seq.var) if not seq.clean[v]]
    if not keep:
        if not len(seq):
            raise ValueError("the sequence has no step to place the buckets in")
        return without_weights(stand_in(seq), buckets)
    n = len(seq)
    before = [0] * (n + 1)  # raw step -> kept steps before it
    for i in range(n):
        before[i + 1] = before[i] + (not seq.clean[seq.var[i]])
    first_use = next((i for i in keep if seq.kind[i] == USE), n)  # the backward's first unpack
    last_save = max((i for i in keep if i < first_use), default=-1)  # the forward's last save
    into = [max(0, before[i + 1] - 1) for i in range(n)]  # raw step -> the kept step it joins
    m = len(keep)
    compute, nonswap = [0.0] * m, [0] * m
    transient, kept = [0] * m, [0] * m
    for i in range(n):
        j = into[i]
        compute[j] += seq.compute[i]
        nonswap[j] = max(nonswap[j], seq.nonswap[i])
        transient[j] = max(transient[j], seq.transient[i])
        kept[j] = max(kept[j], seq.kept[i])
    forward: dict[int, list[int]] = {v: [] for v in clean}
    backward: dict[int, list[int]] = {v: [] for v in clean}
    for i, v in enumerate(seq.var):
        if seq.clean[v]:
            late = i > first_use or (i > last_save and bool(forward[v]))
            (backward if late else forward)[v].append(into[i])
    others = [v for v, c in enumerate(seq.clean) if not c]
    renumber = {v: k for k, v in enumerate(others)}
    out = replace(
        seq, var=[renumber[seq.var[i]] for i in keep], kind=[seq.kind[i] for i in keep],
        sizes=[seq.sizes[v] for v in others], nonswap=nonswap, compute=compute,
        swappable=[seq.swappable[v] for v in others], held_until=[before[min(seq.held_until[v], n)] for v in others],
        freed=[before[min(seq.freed[v], n)] for v in others] if seq.freed else [],
        modules=[seq.modules[v] for v in others] if seq.modules else [], transient=transient, kept=kept,
        node_last=[max(j, into[seq.node_last[i]]) for j, i in enumerate(keep)], clean=[False] * len(others),
        saved_before=[seq.saved_before[i] for i in keep] if seq.saved_before else [],
    )  # fmt: skip
    if buckets is not None:
        if len(buckets) != len(clean):
            raise ValueError(f"the profile streamed {len(clean)} buckets, {len(buckets)} were given")
        unpacks = [into[i] for i in keep if i >= first_use]
        start = into[first_use] if first_use < n else m - 1  # the backward's first step
        for v, b in zip(clean, buckets):
            if b.grad_bytes and not backward[v]:
                mods = {p.rsplit(".", 1)[0] for p in b.params}
                mirror = min(m - 1, max(start, 2 * start - 1 - max(forward[v], default=0)))
                backward[v] = [j for j in unpacks if out.kind[j] == USE and out.modules
                               and out.modules[out.var[j]] in mods] or [mirror]  # fmt: skip
    uses = [BucketUses(tuple(sorted(set(forward[v]))), tuple(sorted(set(backward[v])))) for v in clean]
    return out, uses
