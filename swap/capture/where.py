"""Where a captured operator runs: the phase of the training step and the innermost module, in the forward
and in the backward.

Note [Modules of backward operators]
In the forward, global module hooks keep a stack of the modules running, and an operator belongs to the
innermost one. The backward runs autograd nodes, not modules, so each node is labelled with the module whose forward
created it: when a module's forward returns, its forward hook walks the graph back from the outputs'
``grad_fn`` and labels (``node.metadata``) every node it reaches that no module has labelled yet. Inner
modules return first, so each node gets the innermost module whose forward made it. In the backward an
operator then belongs to the module of ``torch._C._current_autograd_node()``. What this attributes:

- a backward operator to the module whose forward created the node (a Linear's matmul gradients to that
  Linear; the gradient of a residual add to the block whose forward adds);
- the engine's own gradient sums (after a node returns) and the loss's gradient, outside any module: -1;
- a parameter's gradient accumulation to the first module whose outputs reach the parameter;
- a node that no module's outputs reach (an auxiliary loss kept on the side) to no module (-1); a node made
  outside any module whose result a module then consumes (``model(x * 2)`` with ``x`` requiring grad) to
  that module;
- checkpointed regions: their recompute runs the modules' forwards again (the stack says where; the hooks
  are global, so they hold in the backward too), and the recomputed graph of reentrant checkpointing is
  labelled like any other; non-reentrant checkpointing runs the original nodes, labelled in the forward.
  A recomputed operator outside every module on the stack belongs to the region's module, taken as the
  parent of the outermost module its recompute runs: Hugging Face checkpoints a layer's ``forward``, not
  its ``__call__``, so the layer itself is not on the stack while its residual adds are recomputed. A
  recompute that runs no module at all leaves them at -1.

Recompute is told from the backward by grad mode: the engine runs nodes with grad mode off, and both kinds
of ``torch.utils.checkpoint`` (and Hugging Face's gradient checkpointing, built on it) rerun the forward
inside a node with grad mode on.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .trace import PHASE, TraceBuilder

_LABEL = "swap.capture.module"  # key in autograd nodes' metadata: the module index that created them
PHASE_OF = {"batch creation": PHASE["batch"], "forward and loss": PHASE["forward"], "backward": PHASE["backward"],
            "optimizer step": PHASE["optimizer"]}  # fmt: skip


class Where:
    """The phase and the module running now (global forward hooks keep a stack of module paths)."""

    def __init__(self, model: nn.Module, builder: Optional[TraceBuilder] = None) -> None:
        """``builder``: the trace whose module table numbers the modules, and whose operator rows a recompute
        outside any module may fix (``_recomputed``)."""
        self.root = type(model).__name__
        self.names = {id(m): name or self.root for name, m in model.named_modules()}
        self.types = {id(m): type(m).__name__ for m in model.modules()}
        self.builder = builder
        self.indices: dict[int, int] = {}  # id(module) -> its index in the trace's table
        self.region: Optional[int] = None  # module of the checkpointed region being recomputed
        self.pending: list[int] = []  # rows of recomputed operators whose region is not known yet
        self.failure: tuple[Optional[BaseException], Optional[str]] = (None, None)  # an error, and where it rose
        self.stack: list[int] = []
        self.phase = "model construction"
        self.handles: list[Any] = []

    def __enter__(self) -> Where:
        reg = torch.nn.modules.module
        self.handles = [
            reg.register_module_forward_pre_hook(lambda m, _a: self.stack.append(id(m))),
            # always_call: a forward cut short by an exception (checkpoint's early stop of a recompute is one)
            # must leave the stack too
            reg.register_module_forward_hook(lambda m, _a, out: self._pop(m, out), always_call=True),
        ]
        return self

    def _pop(self, m: nn.Module, out: Any) -> None:
        error = sys.exc_info()[1]  # set when the module's forward raised (the hook runs in its except block)
        if error is not None and self.failure[0] is not error:
            self.failure = (error, self.module())  # where it failed, before the stack unwinds
        if torch.is_grad_enabled() and id(m) in self.names:
            self._label(out)
        if self.stack and self.stack[-1] == id(m):
            self.stack.pop()

    def _label(self, out: Any) -> None:
        """Labels the autograd nodes behind ``out`` that no module has labelled yet with the innermost
        module (the one returning now)."""
        stack = [t.grad_fn for t in tree_flatten(_tensors(out))[0] if isinstance(t, torch.Tensor)]
        module = -2  # looked up once there is a node to label
        while stack:
            node = stack.pop()
            if node is None:
                continue
            meta = node.metadata
            if _LABEL in meta:
                continue
            if module == -2:
                module = self.module_index()
            meta[_LABEL] = module
            stack.extend(fn for fn, _ in node.next_functions)

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()

    def innermost(self) -> Optional[int]:
        """id() of the innermost module of the model running now, if any."""
        for key in reversed(self.stack):
            if key in self.names:
                return key
        return None

    def module_index(self) -> int:
        """The innermost module's index in the trace's module table (-1 outside any module)."""
        key = self.innermost()
        if key is None or self.builder is None:
            return -1
        index = self.indices.get(key)
        if index is None:
            index = self.indices[key] = self.builder.module_index(self.names[key])
        return index

    def operator(self) -> tuple[int, int]:
        """(module index, phase code) of the operator about to be recorded as the builder's next row (Note
        [Modules of backward operators])."""
        phase = PHASE_OF.get(self.phase, PHASE["forward"])
        node = torch._C._current_autograd_node() if phase == PHASE["backward"] else None
        if node is not None and torch.is_grad_enabled():
            return self._recomputed(), PHASE["recompute"]
        self.region, self.pending = None, []  # a recompute run, if any, is over
        if node is not None:
            return node.metadata.get(_LABEL, -1), phase
        return self.module_index(), phase

    def _recomputed(self) -> int:
        """The module of a recomputed operator: the innermost on the stack; outside them, the checkpointed
        region's (the parent of the outermost module the recompute runs), once the recompute has run one."""
        key = self.innermost()
        if key is None:
            if self.region is None:  # not known yet: fixed when the first module of the recompute runs
                self.pending.append(len(self.builder.rows))
            return -1 if self.region is None else self.region
        if self.region is None:
            outer = self.names[next(k for k in self.stack if k in self.names)]
            self.region = self.builder.module_index(outer.rsplit(".", 1)[0] if "." in outer else self.root)
            for row in self.pending:
                self.builder.rows[row] = (*self.builder.rows[row][:6], self.region, *self.builder.rows[row][7:])
            self.pending = []
        return self.module_index()

    def module_of(self, error: BaseException) -> Optional[str]:
        """Where ``error`` rose, in words: the module running then, though the stack has unwound since."""
        if self.failure[0] is error:
            return self.failure[1]
        return self.module()

    def module(self) -> Optional[str]:
        """The module (or, in the backward, the autograd node) running now, in words, for errors."""
        key = self.innermost()
        if key is not None:
            return f"module `{self.names[key]}` ({self.types[key]})"
        node = torch._C._current_autograd_node() if self.phase == "backward" else None
        return f"autograd node {node.name()}" if node is not None else None


def _tensors(out: Any) -> Any:
    """A module's output as something pytree flattens: Hugging Face's ModelOutput is a dict subclass."""
    if isinstance(out, dict) and type(out) is not dict:
        return dict(out)
    return out
