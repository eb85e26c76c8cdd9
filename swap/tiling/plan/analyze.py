"""A model's forward pass as an ``OpGraph``: traced with torch.fx, run once on the meta device.

The model is traced symbolically (``torch.fx.symbolic_trace``: leaf modules of ``torch.nn`` stay calls, the
user's own modules are traced through), then every node runs on meta tensors of the input's shape, with the
module's parameters replaced by meta stand-ins (``torch.func.functional_call``): no memory is used, whatever
the image size. Each node's rule (``rules``), its input and output shapes, what autograd saves for it (its
saved-tensor hooks, told apart by storage: its input, its output, or new tensors such as max pooling's
indices), its forward and backward FLOPs (``FlopCounterMode``) are recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from .graph import OpGraph, OpNode
from .rules import Rule, barrier, classify_call, classify_module


class NotTraceable(TypeError):
    """The model's forward cannot be traced into an operator graph (data-dependent control flow, ...)."""


def trace(model: nn.Module) -> fx.GraphModule:
    """``torch.fx.symbolic_trace(model)``, with an error that says what to do when it fails."""
    try:
        return fx.symbolic_trace(model)
    except Exception as e:  # fx raises many types (TraceError, TypeError, NotImplementedError, ...)
        raise NotTraceable(
            f"cannot find the operator graph of {type(model).__name__}: torch.fx could not trace its forward ({e}). "
            "Tile the part that can be traced (e.g. swap.tiled(model.features, ...)), or move the Python control "
            "flow that depends on tensor values out of forward."
        ) from e


@dataclass
class Analysis:
    """The graph and, per node, its rule (which carries the layer the runtime calls on tiles)."""

    graph: OpGraph
    rules: list[Rule]
    fx_nodes: list[fx.Node]
    dtypes: list[torch.dtype]


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta").requires_grad_(t.requires_grad)


def _storage(t: Any) -> Optional[int]:
    return t.untyped_storage()._cdata if isinstance(t, torch.Tensor) else None


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _where(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    if node.op == "call_method":
        return f".{node.target}()"
    return getattr(node.target, "__name__", str(node.target))


def analyze(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> Analysis:
    """Runs ``gm`` on meta tensors shaped like ``inputs`` and describes every node (module modes as set)."""
    modules = dict(gm.named_modules())
    env: dict[fx.Node, Any] = {}
    nodes: list[OpNode] = []
    rules: list[Rule] = []
    fx_nodes: list[fx.Node] = []
    dtypes: list[torch.dtype] = []
    index: dict[fx.Node, int] = {}
    placeholders = iter(inputs)
    outputs: tuple[int, ...] = ()
    for node in gm.graph.nodes:
        if node.op == "output":
            outs = [a for a in tree_flatten(node.args)[0] if isinstance(a, fx.Node)]
            outputs = tuple(index[a] for a in outs if a in index)
            continue
        if node.op == "placeholder":
            x = next(placeholders, None)
            if x is None:
                raise ValueError(f"the model takes more inputs than given: {node.name!r} has no value")
            env[node] = _meta(x) if isinstance(x, torch.Tensor) else x
            if isinstance(x, torch.Tensor):
                index[node] = len(nodes)
                nodes.append(OpNode(node.name, "input", node.name, out_shape=tuple(x.shape), itemsize=x.element_size(),
                                    needs_grad=x.requires_grad))  # fmt: skip
                rules.append(Rule("input"))
                fx_nodes.append(node)
                dtypes.append(x.dtype)
            continue
        if node.op == "get_attr":
            value = gm
            for part in str(node.target).split("."):
                value = getattr(value, part)
            env[node] = _meta(value) if isinstance(value, torch.Tensor) else value
            continue
        args = tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, node.args)
        kwargs = tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, node.kwargs)
        producers = [a for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, fx.Node) and a in index]
        acts = [env[a] for a in producers]
        out, saved, flops, flops_bwd, params, state = _run(node, modules, args, kwargs, acts)
        env[node] = out
        if not isinstance(out, torch.Tensor):
            continue  # a tuple or a number: not an activation the planner tracks; its users become barriers
        first = acts[0] if acts else None
        rule = _rule(node, modules, args, kwargs, len(producers), first, out)
        in_st, out_st = _storage(first), _storage(out)
        save_in = save_out = save_extra = 0
        seen: set[int] = set()
        for t in saved:
            st = _storage(t)
            if st in seen or st is None or st in state:
                continue
            seen.add(st)
            if st == in_st:
                save_in = first.untyped_storage().nbytes()
            elif st == out_st:
                save_out = out.untyped_storage().nbytes()
            elif any(st == _storage(p) for p in acts):
                save_in += t.untyped_storage().nbytes()  # another activation input (a barrier's second operand)
            elif t.numel() * 2 >= out.numel():  # max pooling's indices; not a per-channel statistic
                save_extra += t.untyped_storage().nbytes()
        index[node] = len(nodes)
        nodes.append(OpNode(
            node.name, rule.kind, _where(node), rule.windows if rule.tileable else (), rule.reason,
            tuple(index[p] for p in producers), tuple(first.shape) if first is not None else (), tuple(out.shape),
            out.element_size(), first.element_size() if first is not None else 4, in_st == out_st and in_st is not None,
            save_in, save_out, save_extra, params, flops, flops_bwd, out.requires_grad,
        ))  # fmt: skip
        rules.append(rule)
        fx_nodes.append(node)
        dtypes.append(out.dtype)
    total = sum(p.numel() * p.element_size() for p in gm.parameters()) + sum(
        b.numel() * b.element_size() for b in gm.buffers())  # fmt: skip
    grads = sum(p.numel() * p.element_size() for p in gm.parameters() if p.requires_grad)
    return Analysis(OpGraph(nodes, total, grads, outputs), rules, fx_nodes, dtypes)


def _rule(node: fx.Node, modules: dict[str, nn.Module], args: Any, kwargs: Any, n_acts: int,
          first: Optional[torch.Tensor], out: torch.Tensor) -> Rule:  # fmt: skip
    if first is None or first.dim() < 3 or out.dim() != first.dim():
        return barrier("not an N, C, spatial... activation") if n_acts else barrier("makes a tensor from nothing")
    if first.shape[:2] != out.shape[:2] and node.op != "call_module":
        return barrier("changes the batch or channel dimensions")
    if node.op == "call_module":
        if n_acts != 1:
            return barrier(f"{type(modules[node.target]).__name__} reads {n_acts} activations")
        rule = classify_module(modules[node.target])
    else:
        rule = classify_call(node.target, n_acts, args, kwargs, method=node.op == "call_method")
    if rule.tileable and not rule.windows:
        return Rule(rule.kind, tuple(_identity(first.dim() - 2)), rule.pad_value, rule.reason, rule.layer)
    if rule.tileable and len(rule.windows) != first.dim() - 2:
        return barrier(f"{len(rule.windows)} spatial dimensions on a {first.dim()}-d input")
    return rule


def _identity(n: int) -> list:
    from .geometry import Window

    return [Window() for _ in range(n)]


def _run(node: fx.Node, modules: dict[str, nn.Module], args: Any, kwargs: Any, acts: list[torch.Tensor]
         ) -> tuple[Any, list[torch.Tensor], float, float, int, set[int]]:  # fmt: skip
    """Runs one node on meta tensors: (output, tensors autograd saved, forward FLOPs, backward FLOPs,
    bytes of the parameters it reads that need gradients, storages of its parameters and buffers)."""
    saved: list[torch.Tensor] = []
    params: list[torch.Tensor] = []
    state: dict[str, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    fwd = FlopCounterMode(display=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fwd:
        if node.op == "call_module":
            m = modules[node.target]
            state = {k: _meta(v) for k, v in list(m.named_parameters()) + list(m.named_buffers())}
            params = [v for k, v in state.items() if v.requires_grad]
            out = torch.func.functional_call(m, state, args, kwargs)
        elif node.op == "call_method":
            out = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            out = node.target(*args, **kwargs)
    flops_bwd = 0.0
    if isinstance(out, torch.Tensor) and out.requires_grad:
        wrt = [t for t in acts if t.requires_grad] + params
        if wrt:
            bwd = FlopCounterMode(display=False)
            with bwd:
                torch.autograd.grad(out, wrt, torch.empty_like(out), retain_graph=True, allow_unused=True)
            flops_bwd = float(bwd.get_total_flops())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    storages = {_storage(t) for t in state.values()}
    return out, saved, float(fwd.get_total_flops()), flops_bwd, nbytes, storages
