"""Recompute instead of swap: saved tensors that are a cheap, bitwise-exact function of another saved tensor.

Note [Recompute or swap]
A transformer's MLP saves both the input of its activation (for the activation's own backward) and the
activation's output (for the next Linear's weight gradient): ``out(gelu(fc(x)))`` saves ``u = fc(x)`` and
``gelu(u)``. The second is a pure elementwise function of the first, so instead of copying it to the host and
back, the runtime can rebuild it at its backward use from ``u``, which comes back anyway one step later. That
moves fewer bytes over the link (half of the MLP's, a third of a GPT block's activation bytes) at the cost of
one elementwise kernel. The rebuild runs the same kernel on the same bits, so it is bitwise equal to the
original and gradients do not change (tests/perf/test_recompute.py trains with and without it).

Eligible: a saved tensor (or a view of one) whose storage was produced by an operator in ``RULES`` whose
backward node saved its *input*: GELU, SiLU, leaky ReLU. Operators that save their output (ReLU, sigmoid,
tanh) give nothing to rebuild from. Adds are exact too, but their backward saves no input, so there is no
saved operand to rebuild from.

Three parts:

- ``RecomputeHooks`` (runtime, in swap.runtime.activations.recompute): wraps the swap manager's pack/unpack. An
  eligible tensor is not packed; its handle keeps the rule and the *packed input* (found by reading the
  node's saved input, which calls our unpack hook: we answer it without touching the executor). At unpack
  the input is unpacked through the executor (a use, so the plan prefetches it), the rule runs, and the
  original view is rebuilt. The hooks stay on when the manager declines to swap: the profiled iterations
  that found the run fits the budget rebuilt, and an unswapped run that kept the outputs could exceed it.
- ``recipes`` (planning): which variables of a model's sequence are eligible, and from which variable.
- ``with_recompute`` (simulation): the sequence the runtime records when those variables are rebuilt, so
  the scheduler and the simulator plan it unchanged; ``choose`` keeps the rebuilds that make the simulated
  iteration faster.

Note [A rebuild lives as long as its node]
Autograd unpacks every saved tensor of a backward node before the node runs, and they all live until it
returns: a linear's backward unpacks its rebuilt input (its step in the sequence, the use of the rebuild's
source), then the other tensors it saved (the steps after it, up to the node's last, ``node_last``), and the
rebuilt tensor is on the device through all of them. ``with_recompute`` counted it at its own step only, so
a plan with rebuilds was judged to fit budgets it did not: a GPT whose MLP was rebuilt under
``strategy="auto"`` measured 64 KiB more (the rebuilt GELU output) at the next step of the output
projection's backward, and a retry at 1.05x the ``min_budget`` an ``InfeasibleBudget`` had named was refused
whenever the simulator found the rebuild a little faster than swapping (a matter of measured timings, so it
came and went: tests/swap/model_state/test_ms_entry_budget.py). The rebuilt bytes are now counted until the
node's last step, as the runtime measures them.

Note [No rebuild from a rebuild]
In ``gelu(gelu(x))`` the second GELU's input is the first one's output, itself rebuilt rather than packed: its
saved handle is a ``Recomputed``, not a tensor or the executor's handle. A chain of rebuilds would redo every
link at each use and needs its root's source kept; the planning model (``with_recompute``) rebuilds only from
kept variables. So a candidate whose input is rebuilt is declined (swapped as usual), at runtime and in
``recipes`` alike: in a chain, every other link is rebuilt, from the swapped link before it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ..schedule.sequence import SAVE, USE, Sequence

Rule = Callable[[torch.Tensor], torch.Tensor]

# Node class -> a function of the node returning the rebuild (its saved input -> its output).
RULES: dict[str, Callable[[Any], Rule]] = {
    "GeluBackward0": lambda node: lambda x: F.gelu(x, approximate=node._saved_approximate),
    "SiluBackward0": lambda node: F.silu,
    "LeakyReluBackward0": lambda node: lambda x: F.leaky_relu(x, node._saved_negative_slope),
}
ELEMENTWISE_FLOPS = 8  # per element of a rebuild, for the roofline (GELU's erf is the dearest)
BATCH_NORM_FLOPS = 10  # per element: the statistics' pass and the normalisation (and a ReLU)

# Note [Batch norm rebuilds]
# A ResNet's conv -> batch norm -> ReLU saves two tensors of the same size: the convolution's output (batch
# norm's saved input) and the ReLU's output (ReLU saves its result; the next convolution saves it as its
# input). The second is a function of the first: rerunning the batch norm in training mode on the same input
# recomputes the same batch statistics with the same kernel, so ``relu(batch_norm(c))`` is bitwise the saved
# output, and only ``c`` has to cross the link (HMMS's observation that norm outputs are cheap to recompute; a
# bottleneck then saves 2.5 units instead of 3).
# The rerun writes scratch running statistics of the same dtype and shape (the module's were updated once, in
# the forward), so the kernel is chosen as in the forward (cuDNN or native) and the buffers are untouched.
# Training mode never reads them into its output (it normalises with the batch's statistics; the running ones
# are only updated), so the scratch is left uninitialised: a rebuild runs no kernel besides its own. It is
# still made per rebuild and dropped after it, as before: scratch kept across rebuilds would be device memory
# that lives outside any step, which the budget's byte-exact floors (min_budget) do not count.
# Eligible: the output of a training-mode batch norm node (NativeBatchNorm, CudnnBatchNorm,
# BatchNormWithUpdate), or of a ReLU applied to one, in place or not. The bias is not saved by the node
# (the backward does not need it); it is read from its AccumulateGrad node, so a frozen bias (no such node)
# declines, and a bias or weight changed in place between the forward and the rebuild is an error, not a
# silent difference (autograd checks no versions behind saved-tensor hooks). An eval-mode batch norm
# declines (its output depends on running statistics that may change).
_BATCH_NORM_OPS: dict[str, Callable[..., Any]] = {
    "NativeBatchNormBackward0": lambda x, w, b, rm, rv, eps: torch.ops.aten.native_batch_norm(
        x, w, b, rm, rv, True, 0.1, eps)[0],
    "CudnnBatchNormBackward0": lambda x, w, b, rm, rv, eps: torch.ops.aten.cudnn_batch_norm(
        x, w, b, rm, rv, True, 0.1, eps)[0],
    "BatchNormWithUpdateBackward0": lambda x, w, b, rm, rv, eps: torch.ops.aten._batch_norm_with_update(
        x, w, b, rm, rv, 0.1, eps)[0],
}  # fmt: skip


def _scratch(t: Optional[torch.Tensor]) -> Optional[tuple[torch.Size, torch.dtype, torch.device]]:
    return None if t is None else (t.shape, t.dtype, t.device)


def _batch_norm_rule(node: Any) -> Optional[Rule]:
    """The rerun of a training-mode batch norm node on its saved input, or None (Note [Batch norm rebuilds]).
    The rule holds no reference to the node: a handle kept in the graph must not keep the graph alive."""
    run = _BATCH_NORM_OPS.get(type(node).__name__)
    if run is None or getattr(node, "_saved_training", True) is not True:
        return None
    eps = getattr(node, "_saved_eps", getattr(node, "_saved_epsilon", None))
    nxt = node.next_functions
    bias_fn = nxt[2][0] if len(nxt) > 2 else None
    if eps is None or bias_fn is None or not hasattr(bias_fn, "variable"):
        return None  # a frozen, absent or computed bias: we cannot read it back
    bias, weight = bias_fn.variable, node._saved_weight
    versions = [(name, t, t._version) for name, t in (("bias", bias), ("weight", weight)) if t is not None]
    stats = _scratch(node._saved_running_mean), _scratch(node._saved_running_var)

    def rule(x: torch.Tensor) -> torch.Tensor:
        for name, t, version in versions:
            if t._version != version:
                raise RuntimeError(f"a batch norm's {name} was changed in place between the forward and the backward, "
                                   "so its output cannot be rebuilt: turn rebuilds off (SwapManager(recompute=False)) "
                                   "or update parameters after the backward")  # fmt: skip
        rm, rv = (None if s is None else torch.empty(s[0], dtype=s[1], device=s[2]) for s in stats)  # never read
        return run(x, weight, bias, rm, rv, eps)

    return rule


# Note [Whose saved input]
# Finding a candidate's source means reading its producer's saved input (and, for a batch norm, its weight and
# running statistics), which runs those saved tensors' unpack hook. Ours answers the peek without moving
# anything; another's may not: a node made inside a checkpoint nested in our hooks (a user's
# ``torch.utils.checkpoint``, one of the runtime's recompute regions) saved its tensors through the
# checkpoint's hooks, whose unpack reruns the whole checkpointed module, in the forward, and reads the
# checkpoint's own inputs through our hooks while we peek (the runtime crashed; ``recipes`` planned a rebuild
# from the checkpoint's input). So every tensor our hooks save is noted (``SavedThrough.saving``) with the
# thread's autograd sequence number at that moment: a node saves its tensors right after it is made, when the
# counter is its own ``_sequence_nr() + 1``. A candidate whose node saved nothing through us is declined before
# any of its saved tensors is read. Sequence numbers are per thread: a forward that builds its graph on several
# threads could take one node for another, which the peek then catches as before (no handle of ours: declined).


# The thread's autograd sequence counter (torch's profiler binding, present since torch 1.x).
_sequence_nr: Optional[Callable[[], int]] = getattr(torch._C._autograd, "_get_sequence_nr", None)


class SavedThrough:
    """Which autograd nodes saved tensors through our hooks (Note [Whose saved input]): call ``saving()`` in
    the pack hook for every tensor it saves; ``self(node)`` says whether ``node`` saved any."""

    REMEMBERED = 1 << 16  # sequence numbers kept; a candidate saved later than that after its node is declined

    def __init__(self) -> None:
        self._seqs: set[int] = set()

    def saving(self) -> None:
        if _sequence_nr is None:
            return
        seq = _sequence_nr()
        self._seqs.add(seq)
        if len(self._seqs) > self.REMEMBERED:
            self._seqs = {s for s in self._seqs if s > seq - self.REMEMBERED // 2}

    def __call__(self, node: Any) -> bool:
        if _sequence_nr is None:  # a torch without the counter's getter: no rebuilds rather than a wrong one
            return False
        return node._sequence_nr() + 1 in self._seqs


@dataclass(frozen=True)
class Rebuild:
    """How an eligible saved tensor is rebuilt: ``rule`` applied to the tensor ``node`` saved as ``attribute``
    (read through the saved-tensor hooks, so the caller sees its packed handle)."""

    node: Any
    attribute: str
    rule: Rule
    flops: int  # per element
    passes: int  # tensor-sized reads and writes


def rebuild_of(node: Any, ours: Callable[[Any], bool] = lambda node: True) -> Optional[Rebuild]:
    """The rebuild of the tensor ``node`` produced, if it is eligible (Notes [Recompute or swap], [Batch norm
    rebuilds]); None otherwise. Reads the node's non-tensor fields, and a batch norm's weight and running
    statistics, never its saved input.
    ``ours(n)``: whether node ``n`` saved its tensors through the caller's hooks; a node that did not is
    declined before any of its saved tensors is read, since reading one runs another's unpack hook (Note
    [Whose saved input])."""
    name = type(node).__name__
    make = RULES.get(name)
    if make is not None:
        return Rebuild(node, "_saved_self", make(node), ELEMENTWISE_FLOPS, 2) if ours(node) else None
    if name == "ReluBackward0":
        bn = node.next_functions[0][0] if node.next_functions else None
        norm = _batch_norm_rule(bn) if bn is not None and ours(bn) else None
        return Rebuild(bn, "_saved_input", lambda x: torch.relu_(norm(x)), BATCH_NORM_FLOPS, 5) if norm else None
    norm = _batch_norm_rule(node) if ours(node) else None
    return Rebuild(node, "_saved_input", norm, BATCH_NORM_FLOPS, 3) if norm else None


def producer(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The tensor that owns ``t``'s storage (``t`` or its base) and the node that made it."""
    root = t._base if t._base is not None else t
    return root, root.grad_fn


@dataclass(frozen=True)
class Recipe:
    source: int  # the variable it is rebuilt from
    flops: float
    nbytes: float  # read + written by the rebuild


def recipes(model: torch.nn.Module, inputs: tuple, exclude: Callable[[torch.Tensor], bool] = lambda t: False,
            min_bytes: int = 0, expect_sizes: Optional[list[int]] = None) -> dict[int, Recipe]:  # fmt: skip
    """Runs ``model(*inputs)`` once (any device, e.g. meta) and returns, per eligible variable, its recipe.
    Variables are numbered as the runtime and the trace capture number them: distinct storages in the order
    of their first save, parameters and ``exclude``d tensors left out. ``expect_sizes``: the variable sizes of
    the sequence the recipes are for; a ValueError if this forward numbers its variables differently."""
    def key_of(st: torch.UntypedStorage) -> int:  # meta storages all have data_ptr 0
        return id(st) if st.device.type == "meta" else st.data_ptr()

    params = {key_of(p.untyped_storage()) for p in list(model.parameters()) + list(model.buffers())}
    index: dict[int, int] = {}
    sizes: list[int] = []
    found: dict[int, Recipe] = {}
    peeked: list[Any] = []

    ours = SavedThrough()  # Note [Whose saved input]

    def pack(t: torch.Tensor) -> Any:
        ours.saving()
        st = t.untyped_storage()
        key = key_of(st)
        if key in params or exclude(t) or t.requires_grad and t.is_leaf or st.nbytes() < min_bytes:
            return ("keep", t)
        if key not in index:
            index[key] = len(sizes)
            sizes.append(st.nbytes())
            root, node = producer(t)
            how = rebuild_of(node, ours) if node is not None else None
            if how is not None:
                peeked.clear()
                _ = getattr(how.node, how.attribute)  # our unpack hook records its handle
                if peeked and peeked[0][0] == "var" and peeked[0][1] not in found:  # Note [No rebuild from a rebuild]
                    n = root.numel()
                    found[index[key]] = Recipe(peeked[0][1], how.flops * n, how.passes * n * root.element_size())
                # A handle left here would keep its tensor, and through its grad_fn the whole graph, alive:
                # the graph holds this closure (its unpack hook), a cycle through C++ the GC cannot see.
                peeked.clear()
        return ("var", index[key], t)

    def unpack(h: Any) -> torch.Tensor:
        peeked.append(h)
        return h[-1]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        model(*inputs)
    if expect_sizes is not None and sizes != expect_sizes[: len(sizes)]:
        raise ValueError("the forward saves other variables than the sequence has (another model, batch or input?)")
    return found


def with_recompute(seq: Sequence, chosen: dict[int, Recipe], seconds: Callable[[Recipe], float]) -> Sequence:
    """The sequence the runtime records when the ``chosen`` variables are rebuilt (Note [Recompute or swap]):
    a chosen variable is never saved (its forward bytes stay until the forward drops them, not ours to move);
    each backward use of it becomes a use of its source, whose step also computes the rebuild and holds its
    result, as do the later steps of the same backward node (Note [A rebuild lives as long as its node])."""
    for v, r in chosen.items():
        if seq.sizes[r.source] <= 0 or r.source in chosen:
            raise ValueError(f"variable {v} would be rebuilt from {r.source}, which is not a kept variable")
    # Step indices move: a removed forward save's step joins the step before it.
    removed = [i for i, (v, k) in enumerate(zip(seq.var, seq.kind)) if v in chosen and k == SAVE]

    def moved(step: int) -> int:
        return step - bisect.bisect_left(removed, step)

    var, kind, nonswap, compute, transient, kept, node_last = [], [], [], [], [], [], []
    first_save = {v: seq.var.index(v) for v in chosen}
    node_held: list[tuple[int, int]] = []  # (last step of the node, bytes): rebuilds its node still holds
    for i, (v, k) in enumerate(zip(seq.var, seq.kind)):
        extra = sum(seq.sizes[c] for c in chosen if first_save[c] <= i < seq.held_until[c])  # in the forward
        if var:  # Note [A rebuild lives as long as its node]: earlier rebuilds of this step's node
            extra += sum(b for last, b in node_held if last >= len(var))
        if v in chosen and k == SAVE:
            if var:  # the step disappears: its compute and memory join the step before
                compute[-1] += seq.compute[i]
                nonswap[-1] = max(nonswap[-1], seq.nonswap[i] + extra)
                transient[-1] = max(transient[-1], seq.transient[i])
                kept[-1] = max(kept[-1], seq.kept[i])
            continue
        rebuilt = seq.sizes[v] if v in chosen else 0  # the rebuild's output, made during the use
        if rebuilt and moved(seq.node_last[i]) > len(var):
            node_held.append((moved(seq.node_last[i]), rebuilt))
        var.append(chosen[v].source if v in chosen else v)
        kind.append(USE if v in chosen else k)
        nonswap.append(seq.nonswap[i] + extra + rebuilt)
        compute.append(seq.compute[i] + (seconds(chosen[v]) if v in chosen else 0.0))
        transient.append(seq.transient[i] + rebuilt)
        kept.append(seq.kept[i])
        node_last.append(max(len(var) - 1, moved(seq.node_last[i])))
    held = [moved(h) if v not in chosen else 0 for v, h in enumerate(seq.held_until)]
    freed = [moved(f) for f in seq.freed]
    return replace(seq, var=var, kind=kind, nonswap=nonswap, compute=compute, held_until=held, freed=freed,
                   transient=transient, kept=kept, node_last=node_last)  # fmt: skip


def choose(seq: Sequence, found: dict[int, Recipe], seconds: Callable[[Recipe], float],
           step_time: Callable[[Sequence], float]) -> tuple[dict[int, Recipe], float]:  # fmt: skip
    """Greedy: rebuild the largest eligible variables first, keeping each that makes ``step_time`` (e.g. the
    simulated window schedule) shorter. Returns the chosen recipes and the step time."""
    chosen: dict[int, Recipe] = {}
    best = step_time(seq)
    for v in sorted(found, key=lambda v: -seq.sizes[v]):
        if v not in seq.var or found[v].source in chosen:
            continue
        trial = {**chosen, v: found[v]}
        t = step_time(with_recompute(seq, trial, seconds))
        if t < best:
            chosen, best = trial, t
    return chosen, best
