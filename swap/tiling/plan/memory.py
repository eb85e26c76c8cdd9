"""Device bytes of one training step of an ``OpGraph`` in eager PyTorch: live tensors at every operator.

Note [The eager memory model]
Between operators, eager PyTorch holds: the parameters and buffers; the model's inputs; every activation
until its last forward user has run, and beyond that while autograd holds it saved (until the backward of
the *earliest* node that saved it has run); new tensors a node saves (max pooling's indices); in backward,
each activation's gradient from the backward of its last user until the backward of its producer, and the
parameters' gradients from their node's backward to the end. In-place operators and views share their
input's memory (one storage). Each node may add bytes of its own while it runs (``transient``: a tiled
segment's tile working set, Note [What a tiled segment holds] in swap/tiling/plan/cost.py).

With ``swapped=True`` saved tensors are on the host between their save and their use, as the swap runtime
moves them (the floor of any swap schedule: what the running node itself reads must be on the device).

The model counts what is live between operators, which is what ``swap.LiveBytesMeter`` measures on CPU;
memory an operator allocates and frees inside itself is not in it (Note [What the meter cannot see]).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .graph import OpNode


@dataclass
class Peak:
    """The highest live bytes of the step, where (node index and "forward"/"backward"), and the curve."""

    bytes: int
    node: int
    phase: str
    forward: list[int] = field(default_factory=list)
    backward: list[int] = field(default_factory=list)  # indexed like the nodes (0 where a node has no backward)


def step_peak(nodes: list[OpNode], outputs: tuple[int, ...], base: int = 0,
              transient_fwd: Optional[dict[int, int]] = None, transient_bwd: Optional[dict[int, int]] = None,
              swapped: bool = False, output_grads: bool = True) -> Peak:  # fmt: skip
    """Live bytes at every node's forward and backward (Note [The eager memory model]).

    Args:
        nodes: the forward pass in execution order (inputs first).
        outputs: the nodes the model returns (live to the end; their gradients start the backward).
        base: bytes live throughout (parameters, buffers, what the caller holds besides the inputs).
        transient_fwd, transient_bwd: extra bytes a node holds while its forward / backward runs.
        swapped: saved tensors are on the host except while their own node runs.
        output_grads: the outputs' gradients are live from the start of backward (a loss over them).
    """
    tf, tb = transient_fwd or {}, transient_bwd or {}
    n = len(nodes)
    sid = list(range(n))
    for i, node in enumerate(nodes):
        if node.alias and node.inputs:
            sid[i] = sid[node.inputs[0]]
    size: dict[int, int] = {}
    last_use: dict[int, int] = {}
    users: list[list[int]] = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        s = sid[i]
        size[s] = max(size.get(s, 0), node.out_bytes)
        last_use[s] = max(last_use.get(s, i), i)
        for j in node.inputs:
            users[j].append(i)
            last_use[sid[j]] = max(last_use.get(sid[j], j), i)
    pinned = {sid[i] for i, node in enumerate(nodes) if node.kind == "input"} | {sid[i] for i in outputs}
    savers: dict[int, list[int]] = {}
    extra: dict[int, int] = {}  # node -> bytes of new tensors it saves
    for i, node in enumerate(nodes):
        if node.save_in and node.inputs:
            savers.setdefault(sid[node.inputs[0]], []).append(i)
        if node.save_out:
            savers.setdefault(sid[i], []).append(i)
        if node.save_extra:
            extra[i] = node.save_extra

    fwd = [0] * n
    for i in range(n):
        live = base + tf.get(i, 0)
        for s, b in size.items():
            if s > i:
                continue
            used_now = s == sid[i] or any(sid[j] == s for j in nodes[i].inputs)
            held = s in pinned or last_use[s] >= i or (not swapped and min(savers.get(s, [n])) <= i)
            live += b if (held or used_now) else 0
        if not swapped:
            live += sum(b for j, b in extra.items() if j <= i)
        else:
            live += extra.get(i, 0)
        fwd[i] = live

    bwd = [0] * n
    # an activation's gradient exists from the backward of its last user (the first to run) to its own
    grad_from = {k: n if k in outputs and output_grads else max(users[k], default=-1) for k in range(n)}
    param_grads = 0
    for i in range(n - 1, -1, -1):
        node = nodes[i]
        if node.kind == "input" or not node.needs_grad:
            continue
        param_grads += node.params
        live = base + param_grads + tb.get(i, 0)
        for s, b in size.items():
            if s in pinned:
                live += b
            elif s in savers and (i in savers[s] if swapped else min(savers[s]) <= i):
                live += b
        live += extra.get(i, 0) if swapped else sum(b for j, b in extra.items() if j <= i)
        live += sum(nodes[k].out_bytes for k in range(n) if nodes[k].needs_grad and k <= i <= grad_from[k])
        bwd[i] = live
    best_f = max(range(n), key=lambda i: fwd[i]) if n else 0
    best_b = max(range(n), key=lambda i: bwd[i]) if n else 0
    if n and bwd[best_b] > fwd[best_f]:
        return Peak(bwd[best_b], best_b, "backward", fwd, bwd)
    return Peak(fwd[best_f] if n else base, best_f, "forward", fwd, bwd)
