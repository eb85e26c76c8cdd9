"""Recompute regions: the plan types, and the sequence the runtime records when modules are checkpointed.

Note [Recompute regions]
A region is a module whose forward the runtime reruns under non-reentrant ``torch.utils.checkpoint``
(swap.runtime.auto.regions). Its ``keep`` names the operators whose outputs are still saved, and so still
swappable like any saved tensor; every other operator is recomputed. Full checkpointing keeps none. What the
runtime sees of a checkpointed call:

- forward: the checkpoint saves the call's tensor arguments through our hooks (a save of each, at the call's
  start), and the kept operators hand their outputs to the executor (a save each, when they run). The saves
  autograd makes inside the call go to the checkpoint, not to us: those steps vanish, and their tensors stay
  in the forward's memory until the forward drops them (``held_until``), as non-swappable bytes.
- backward: at the first backward use of anything the call saved, the checkpoint unpacks its inputs (a use of
  each), reruns the forward (its operators' seconds, less the kept ones), and the kept operators read their
  outputs back (a use each). The recomputed tensors are not ours: they live, non-swappable, until the last
  backward node that needs them has run (``node_last``). Inputs and kept outputs are held by the checkpoint
  for as long as a node still needs them, and their handles die with the region's graph (``freed``).

Note [Early stop]
Non-reentrant checkpoint stops the rerun as soon as every tensor the call saved has been recomputed: the
operators after the call's last save are not rerun. So an operator is worth keeping only if its output is
saved inside the call (``OpTable.keep_candidates``): otherwise the rerun never reads it back.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Optional

from ..schedule.sequence import SAVE, USE, Sequence
from .ops import Op, OpTable, RegionCall, check_regions, in_place_name
from .recompute import Recipe, with_recompute

REBUILD_OPS = ("aten.gelu.default", "aten.silu.default", "aten.leaky_relu.default")  # swap.joint.recompute.RULES
BATCH_NORM_OPS = ("aten.native_batch_norm.default", "aten._batch_norm_with_update.default",
                  "aten.cudnn_batch_norm.default")  # Note [Batch norm rebuilds], swap.joint.recompute
RELU_OPS = ("aten.relu.default", "aten.relu_.default")


@dataclass(frozen=True)
class Region:
    """A module to checkpoint (its path from the root module) and the operators whose outputs it keeps, as
    (operator name, ordinal of that name within the call): empty is full checkpointing."""

    path: str
    keep: frozenset[tuple[str, int]] = frozenset()


@dataclass(frozen=True)
class RecomputePlan:
    """What to recompute: regions (Note [Recompute regions]) and the elementwise rebuilds (Note [Recompute
    or swap])."""

    regions: tuple[Region, ...] = ()
    rebuild: bool = False

    @property
    def paths(self) -> list[str]:
        return [r.path for r in self.regions]

    def describe(self) -> str:
        if not self.regions:
            return "no regions" + (", rebuilds" if self.rebuild else "")
        kept = sum(len(r.keep) for r in self.regions)
        return f"{len(self.regions)} region(s), {kept} kept operator(s)" + (", rebuilds" if self.rebuild else "")


@dataclass
class RegionModel:
    """``apply_regions``'s result: the sequence, and what the regions cost and remove."""

    sequence: Sequence
    recompute_seconds: float = 0.0  # per iteration, regions and rebuilds
    # per step of the sequence the plan was applied to, the step of ``sequence`` that runs its compute (a step
    # the plan removes joins the one before); empty: the same steps (what places weights:
    # swap/schedule/model_state/weights.py)
    holds: list[int] = field(default_factory=list)
    recomputed_bytes: dict[str, int] = field(default_factory=dict)  # per region path: saved bytes recomputed
    rebuilt: int = 0  # elementwise rebuilds chosen


@dataclass
class _Entry:
    var: int  # a variable of the original sequence, or a negative storage id (Note [Operator table])
    kind: str
    t: int  # the original step whose interval this entry lies in (for memory and for mapping steps)
    compute: float = 0.0
    nonswap: int = 0
    transient: int = 0
    kept: int = 0
    hold: Optional[int] = None  # original step until whose end the tensor used here is held


@dataclass
class _Call:
    call: RegionCall
    saved: set[int]  # variables the call saved
    kept: list[int]  # kept storages (variables or negative ids), in operator order
    kept_at: list[int]  # the step each is saved before
    recomputed: set[int]  # saved variables that are recomputed
    uses: list[int]  # backward steps that read what the call saved
    seconds: float  # rerun time
    rerun_between: list[float]  # seconds before each kept use, and after the last


def apply_regions(seq: Sequence, table: OpTable, plan: RecomputePlan) -> RegionModel:
    """The sequence the runtime records with ``plan`` applied (Note [Recompute regions]), variables numbered
    in first-save order as the runtime numbers them; ``plan.rebuild`` then applies the elementwise rebuilds
    outside regions (``with_recompute``)."""
    error = check_regions(table, plan.paths)
    if error is not None:
        raise ValueError(error)
    keep_of = {r.path: r.keep for r in plan.regions}
    saves_at: dict[int, list[int]] = defaultdict(list)  # variable -> its save steps, and its use steps
    uses_at: dict[int, list[int]] = defaultdict(list)
    for i, (v, k) in enumerate(zip(seq.var, seq.kind)):
        if k == SAVE:
            saves_at[v].append(i)
        elif k == USE:
            uses_at[v].append(i)
    calls = [_prepare(seq, table, c, keep_of[c.path], saves_at, uses_at) for c in table.calls if c.path in keep_of]
    calls = [c for c in calls if c is not None]
    out = _rewrite(seq, table, calls)
    model = RegionModel(out[0], sum(c.seconds for c in calls), holds=out[2])
    for c in calls:
        b = sum(seq.sizes[v] for v in c.recomputed)
        model.recomputed_bytes[c.call.path] = model.recomputed_bytes.get(c.call.path, 0) + b
    if plan.rebuild:
        inside = set().union(*(c.saved for c in calls)) if calls else set()
        found, seconds = rebuild_recipes(seq, table, exclude=inside)
        renamed = {out[1][v]: Recipe(out[1][r.source], r.flops, r.nbytes) for v, r in found.items()
                   if v in out[1] and r.source in out[1]}  # fmt: skip
        chosen = _valid_recipes(out[0], renamed)
        if chosen:
            model.sequence = with_recompute(out[0], chosen, lambda r: seconds.get((r.flops, r.nbytes), 0.0))
            removed = {i for i, (v, k) in enumerate(zip(out[0].var, out[0].kind)) if v in chosen and k == SAVE}
            kept_before = list(itertools.accumulate((i not in removed for i in range(len(out[0]))), initial=0))
            # a removed save's compute joins the kept step before it (with_recompute)
            model.holds = [max(0, kept_before[h] - (h in removed)) for h in model.holds]
            model.recompute_seconds += sum(seconds.get((r.flops, r.nbytes), 0.0) * _uses(out[0], v)
                                           for v, r in chosen.items())  # fmt: skip
            model.rebuilt = len(chosen)
    return model


def with_regions(seq: Sequence, table: OpTable, plan: RecomputePlan) -> Sequence:
    """The sequence the runtime records with ``plan``'s regions checkpointed (and its rebuilds), like
    ``with_recompute`` for rebuilds alone."""
    return apply_regions(seq, table, plan).sequence


def rebuild_recipes(seq: Sequence, table: OpTable, exclude: set[int] = frozenset()) -> tuple[dict[int, Recipe], dict]:
    """The rebuilds the op table shows, outside ``exclude``: {variable: recipe}, and each recipe's seconds keyed
    by (flops, nbytes). Elementwise: GELU, SiLU, leaky ReLU outputs saved with their saved input. Batch norm
    (Note [Batch norm rebuilds], swap.joint.recompute): a training batch norm's saved output, or the ReLU
    applied to it, rebuilt from the batch norm's saved input."""
    saved = set(seq.var)
    found: dict[int, Recipe] = {}
    seconds: dict[tuple[float, float], float] = {}

    def add(o: int, s: int, flops: float, nbytes: float, secs: float) -> None:
        if o < 0 or s < 0 or o in exclude or s in exclude or o not in saved or s not in saved or o in found:
            return
        if s in found:  # Note [No rebuild from a rebuild]
            return
        r = Recipe(s, flops, nbytes)
        found[o] = r
        seconds[(r.flops, r.nbytes)] = secs

    ops = table.ops
    first_save: dict[int, int] = {}
    for i, (v, k) in enumerate(zip(seq.var, seq.kind)):
        if k == SAVE:
            first_save.setdefault(v, i)
    for j, op in enumerate(ops):
        if not op.outputs or not op.inputs:
            continue
        o, s = op.outputs[0], op.inputs[0]
        if op.name in REBUILD_OPS:
            add(o, s, op.flops, op.nbytes or 2.0 * seq.sizes[o], op.seconds)
        elif op.name in BATCH_NORM_OPS:
            # The trace shows the ReLU that follows (in place: it writes the norm's output; out of place: its
            # own output), not which tensor it read: the operator right after the norm is taken to be its. Any
            # other in-place operator before the output's first save (a residual ``out += identity``) may
            # write it: the runtime would decline that output, so the plan does too.
            nxt = ops[j + 1] if j + 1 < len(ops) else None
            relu = nxt is not None and nxt.name in RELU_OPS
            if relu and nxt.outputs:
                o = nxt.outputs[0]
            if o not in first_save or _written_before(ops, j + 1 + relu, first_save[o]):
                continue
            flops = op.flops + (nxt.flops if relu else 0.0)
            nbytes = (op.nbytes or 3.0 * seq.sizes[o]) + (nxt.nbytes if relu else 0.0)
            add(o, s, flops, nbytes, op.seconds + (nxt.seconds if relu else 0.0))
    return found, seconds


def _written_before(ops: list[Op], start: int, step: int) -> bool:
    """Whether an in-place operator runs from ``ops[start]`` until sequence step ``step`` (ops are in step
    order, so the scan stops there)."""
    for q in itertools.islice(ops, start, None):
        if q.step > step:
            return False
        if in_place_name(q.name):
            return True
    return False


def _valid_recipes(seq: Sequence, found: dict[int, Recipe]) -> dict[int, Recipe]:
    return {v: r for v, r in found.items() if r.source not in found and v in seq.var and r.source in seq.var}


def _uses(seq: Sequence, v: int) -> int:
    return sum(1 for x, k in zip(seq.var, seq.kind) if x == v and k == USE)


def _prepare(seq: Sequence, table: OpTable, c: RegionCall, keep: frozenset, save_steps: dict[int, list[int]],
             uses_by_var: dict[int, list[int]]) -> Optional[_Call]:  # fmt: skip
    """A call's part of the rewrite; ``save_steps`` / ``uses_by_var``: each variable's save and use steps."""
    lo, hi = c.steps
    saves = [i for i in range(lo, hi) if seq.kind[i] == SAVE]
    if not saves:
        return None
    saved = {seq.var[i] for i in saves}
    inside = {v: all(lo <= i < hi for i in save_steps[v]) for v in saved}
    pure = [u for v in saved if inside[v] for u in uses_by_var[v]]
    span_from = pure or [u for v in saved for u in uses_by_var[v]]
    if not span_from:
        uses: list[int] = []
    else:
        a, b = min(span_from), max(span_from)
        uses = sorted(u for v in saved for u in uses_by_var[v] if a <= u <= b)
    keys = table.op_keys(c)
    ops = table.ops
    kept_ops = [j for j in range(*c.ops) if (keys[j - c.ops[0]] in keep and ops[j].keepable) or ops[j].blocker]
    kept: list[int] = []
    kept_at: list[int] = []
    for j in kept_ops:
        for v in table.ops[j].outputs:
            if v not in kept and (v < 0 or v in saved):
                kept.append(v)
                kept_at.append(max(lo, table.ops[j].step))
    inputs = {v for v, _ in c.inputs if v >= 0}
    recomputed = saved - set(kept) - inputs
    # Note [Early stop]: the rerun ends with the operator that made the call's last save.
    last_save = saves[-1]
    stop = max((j for j in range(*c.ops) if table.ops[j].step <= last_save), default=c.ops[0] - 1)
    rerun = [j for j in range(c.ops[0], stop + 1) if j not in kept_ops]
    between = [0.0] * (len(kept) + 1)
    marks = [j for j in kept_ops for v in table.ops[j].outputs if v in kept][: len(kept)]
    for j in rerun:
        k = sum(1 for m in marks if m < j)
        between[k] += table.ops[j].seconds
    return _Call(c, saved, kept, kept_at, recomputed, uses, sum(table.ops[j].seconds for j in rerun), between)


def _rewrite(seq: Sequence, table: OpTable, calls: list[_Call]) -> tuple[Sequence, dict[int, int], list[int]]:
    n = len(seq)
    sizes = dict(enumerate(seq.sizes))
    for c in calls:
        for v, b in c.call.inputs:
            sizes.setdefault(v, b)
        for v in c.kept:
            if v < 0:
                sizes.setdefault(v, _size_of(table, c.call, v))
    first_save = {}
    for i, (v, k) in enumerate(zip(seq.var, seq.kind)):
        if k == SAVE:
            first_save.setdefault(v, i)
    last_use_in: dict[tuple[int, int], int] = {}  # (call index, variable) -> last use step attributed to it
    for ci, c in enumerate(calls):
        for u in c.uses:
            last_use_in[(ci, seq.var[u])] = u

    # Memory that changes hands, by original step (difference arrays).
    extra = [0] * (n + 1)

    def add(a: int, b: int, nbytes: int) -> None:
        a, b = max(0, a), min(n, b)
        if a < b:
            extra[a] += nbytes
            extra[b] -= nbytes

    for ci, c in enumerate(calls):
        for v in c.recomputed:
            if not seq.swappable[v]:
                continue  # already in nonswap where the profile saw it alive
            add(first_save[v], max(first_save[v] + 1, seq.held_until[v]), seq.sizes[v])  # forward: held by it
            if c.uses:
                end = seq.node_last[last_use_in.get((ci, v), c.uses[0])] + 1
                add(c.uses[0], end, seq.sizes[v])  # backward: recomputed, held until its last node ran
        for v, b in list(c.call.inputs) + [(v, sizes[v]) for v in c.kept]:
            if v < 0:  # not a variable before: its bytes were in nonswap during the call, now they are ours
                add(c.call.steps[0], c.call.steps[1], -b)
    for i in range(1, n + 1):
        extra[i] += extra[i - 1]

    def base(i: int) -> int:
        return max(0, seq.nonswap[i] + extra[i])

    rerun_transient = {ci: max([seq.transient[i] for i in range(*c.call.steps)] + [0]) for ci, c in enumerate(calls)}
    before: dict[int, list[tuple[float, list[_Entry]]]] = defaultdict(list)  # entries inserted before a step
    dropped: set[int] = set()
    for ci, c in enumerate(calls):
        lo, hi = c.call.steps
        dropped.update(i for i in range(lo, hi) if seq.kind[i] == SAVE)
        anchor = max(0, lo - 1)
        for k, (v, _b) in enumerate(c.call.inputs):
            before[lo].append((c.call.ops[0] - 1 + k / (len(c.call.inputs) + 1),
                               [_Entry(v, SAVE, anchor, nonswap=base(anchor), kept=seq.kept[anchor])]))  # fmt: skip
        for k, (v, at) in enumerate(zip(c.kept, c.kept_at)):
            a = max(0, min(at, n) - 1)
            before[at].append((c.call.ops[0] + k, [_Entry(v, SAVE, a, nonswap=base(a), kept=seq.kept[a])]))
        if not c.uses:
            continue
        r = c.uses[0]
        dropped.update(c.uses)
        tr = rerun_transient[ci]

        def hold(v: int, ci: int = ci, r: int = r) -> int:
            u = last_use_in.get((ci, v))
            return seq.node_last[u] if u is not None else r

        # The rerun runs at step r, before its own backward work: what is live there (with the recomputed
        # tensors, extra[r]), and the rerun's working set where the forward's exceeded both the step's working
        # set and the tensors it recomputes (the forward's step peaks include tensors saved later).
        recomputed = sum(seq.sizes[v] for v in c.recomputed if seq.swappable[v])
        rerun = base(r) + max(0, tr - seq.transient[r] - recomputed)
        group = [_Entry(v, USE, r, hold=hold(v)) for v, _b in c.call.inputs]
        group += [_Entry(v, USE, r, hold=hold(v)) for v in c.kept]
        if not group:  # nothing of ours is read: the rerun's time and memory join the step before
            group = [_Entry(0, "merge", r, c.seconds, rerun, seq.transient[r] + recomputed, seq.kept[r])]
        else:
            for e in group:
                e.nonswap, e.transient, e.kept = rerun, seq.transient[r] + recomputed, seq.kept[r]
            # The rerun's seconds: before the first kept use (on the last input's step), between kept uses, after.
            n_in = len(c.call.inputs)
            group[max(0, n_in - 1)].compute += c.rerun_between[0]
            for k in range(len(c.kept)):
                group[n_in + k].compute += c.rerun_between[k + 1]
        before[r].append((float("inf"), group))
    entries: list[_Entry] = []
    carry = _Entry(0, "merge", 0)
    carried = False

    def merge(into: _Entry, e: _Entry) -> None:
        into.compute += e.compute
        into.nonswap = max(into.nonswap, e.nonswap)
        into.transient = max(into.transient, e.transient)
        into.kept = max(into.kept, e.kept)

    def emit(e: _Entry) -> None:
        nonlocal carried
        if e.kind == "merge":
            if entries:
                merge(entries[-1], e)
            else:
                merge(carry, e)
                carried = True
            return
        if carried:
            merge(e, carry)
            carried = False
        entries.append(e)

    holds = [0] * n  # original step -> the entry its compute is in
    for i in range(n + 1):
        for _key, group in sorted(before.get(i, []), key=lambda x: x[0]):
            for e in group:
                emit(e)
        if i == n:
            break
        e = _Entry(seq.var[i], seq.kind[i], i, seq.compute[i], base(i), seq.transient[i], seq.kept[i])
        if seq.kind[i] == USE:
            e.hold = seq.node_last[i]
        if i in dropped:
            emit(replace(e, kind="merge"))
        else:
            emit(e)
        holds[i] = max(0, len(entries) - 1)
    # Step indices: an original step maps to the entries standing for its interval.
    first_at = [len(entries)] * (n + 1)  # first entry index with t >= i
    last_at = [-1] * (n + 1)  # last entry index with t <= i
    for k, e in enumerate(entries):
        first_at[e.t] = min(first_at[e.t], k)
        last_at[e.t] = max(last_at[e.t], k)
    for i in range(n - 1, -1, -1):
        first_at[i] = min(first_at[i], first_at[i + 1])
    for i in range(1, n + 1):
        last_at[i] = max(last_at[i], last_at[i - 1])
    # Renumber: first-save order, as the runtime numbers variables; clean variables (buckets of weights, at home on
    # the host: Note [Clean variables] in swap.schedule.sequence) are never saved, and the runtime numbers them
    # first, at the iteration's start.
    new_id: dict[int, int] = {}
    for v in sorted({e.var for e in entries if e.var >= 0 and seq.clean[e.var]}):
        new_id[v] = len(new_id)
    for e in entries:
        if e.kind == SAVE and e.var not in new_id:
            new_id[e.var] = len(new_id)
    if any(e.var not in new_id for e in entries):
        missing = next(e.var for e in entries if e.var not in new_id)
        raise ValueError(f"variable {missing} is read in the backward but no longer saved: inconsistent op table")
    m = len(entries)
    node_last = []
    for k, e in enumerate(entries):
        node_last.append(k if e.kind == SAVE or e.hold is None else max(k, min(m - 1, last_at[min(n, e.hold)])))
    region_vars = {v: ci for ci, c in enumerate(calls) for v in list(c.kept) + [x for x, _ in c.call.inputs]}
    new_sizes = [0] * len(new_id)
    swappable = [True] * len(new_id)
    held_until = [0] * len(new_id)
    freed = [m] * len(new_id)
    modules = [""] * len(new_id)
    last_access = {}
    for k, e in enumerate(entries):
        last_access[e.var] = k
    ends = seq.ends()
    for old, new in new_id.items():
        new_sizes[new] = sizes[old]
        if old >= 0:
            swappable[new] = seq.swappable[old]
            held_until[new] = first_at[min(n, seq.held_until[old])] if seq.held_until[old] else 0
            freed[new] = first_at[min(n, ends[old])]
            modules[new] = seq.modules[old] if seq.modules else ""
        if old in region_vars:
            c = calls[region_vars[old]]
            if old < 0:
                held_until[new] = first_at[min(n, c.call.steps[1])]
                modules[new] = c.call.path
            region_end = seq.node_last[c.uses[-1]] + 1 if c.uses else c.call.steps[1]
            freed[new] = max(freed[new] if old >= 0 else 0, first_at[min(n, region_end)])
        freed[new] = min(m, max(freed[new], last_access[old] + 1))
        held_until[new] = min(held_until[new], freed[new])
    out = Sequence(
        [new_id[e.var] for e in entries], [e.kind for e in entries], new_sizes, [e.nonswap for e in entries],
        [e.compute for e in entries], swappable, held_until, freed=freed, modules=modules,
        transient=[e.transient for e in entries], kept=[e.kept for e in entries], base=seq.base, node_last=node_last,
        clean=[old >= 0 and seq.clean[old] for old in new_id],
    )  # fmt: skip
    return out, {old: new for old, new in new_id.items() if old >= 0}, holds


def _size_of(table: OpTable, call: RegionCall, storage: int) -> int:
    for op in table.ops[call.ops[0] : call.ops[1]]:
        if storage in op.outputs:
            k = op.outputs.index(storage)
            return op.sizes[k] if k < len(op.sizes) else op.out_bytes // max(1, len(op.outputs))
    return 0
