"""``TiledModel``: the user's model with its FT segments run tile by tile, planned per input shape.

The model is traced once (torch.fx); at the first call with an input shape (and set of train/eval modes),
its graph is analysed on the meta device, the planner picks segments and tile counts for the budget
(Note [Choosing segments and tiles] in swap/tiling/plan/choose.py), and a copy of the traced graph has
each segment's nodes replaced by one ``TiledSegment``. The user's modules are called as they are, so the
parameters, their gradients and the state dict are the user's model's.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ..plan.analyze import Analysis, analyze, trace
from ..plan.choose import TilePlan, plan_tiles
from .held import HeldState
from .progress import Progress, progress_sink
from .segment import Step, TiledSegment, window_call


def _call(node: fx.Node, rule: Any, gm: fx.GraphModule, producer: fx.Node) -> Callable[[torch.Tensor], torch.Tensor]:
    """The node as a function of its one activation input (its other arguments are constants)."""
    if rule.kind == "window":
        return window_call(rule.layer, len(rule.windows))
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return lambda x: module(x)

    node_args, node_kwargs = node.args, node.kwargs  # read now: erasing the node from its graph clears them

    def bind(x: torch.Tensor) -> tuple[tuple, dict]:
        sub = lambda a: x if a is producer else a  # noqa: E731
        return tree_map(sub, node_args), tree_map(sub, node_kwargs)

    if node.op == "call_method":
        name = str(node.target)

        def method(x: torch.Tensor) -> torch.Tensor:
            args, kwargs = bind(x)
            return getattr(args[0], name)(*args[1:], **kwargs)

        return method
    target = node.target

    def function(x: torch.Tensor) -> torch.Tensor:
        args, kwargs = bind(x)
        return target(*args, **kwargs)

    return function


def _params(node: fx.Node, gm: fx.GraphModule) -> list[torch.Tensor]:
    if node.op == "call_module":
        return list(gm.get_submodule(str(node.target)).parameters())
    return []


class TiledModel(nn.Module):
    """``model`` with its FT segments tiled to fit ``budget`` (see ``swap.tiled``).

    ``plan_for(*inputs)`` returns the ``TilePlan`` (and the graph) it uses for inputs of those shapes;
    ``last_plan`` is the plan of the latest call. The plan counts what the step holds besides the graph, the
    optimizer's state and kept gradients, and is made again when that grows (Note [What the step holds
    besides the graph] in swap/tiling/run/held.py)."""

    def __init__(self, model: nn.Module, budget: Optional[int], *, tiles: Union[None, int, tuple[int, ...]] = None,
                 device: Any = None, extra: int = 0, swapped: bool = False,
                 progress: Progress = False) -> None:  # fmt: skip
        super().__init__()
        self.model = model
        self.budget, self.tiles, self.device_profile = budget, tiles, device
        self.extra, self.swapped, self.progress = extra, swapped, progress
        self._traced = trace(model)
        self._held = HeldState(list(model.parameters()))
        # input key -> (graph, plan, analysis, the held bytes the plan counted)
        self._built: dict[tuple, tuple[fx.GraphModule, TilePlan, Analysis, int]] = {}
        self.last_plan: Optional[TilePlan] = None

    def _key(self, inputs: tuple) -> tuple:
        shapes = tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) if isinstance(t, torch.Tensor) else t
                       for t in inputs)  # fmt: skip
        return shapes, tuple(m.training for m in self.model.modules())

    def plan_for(self, *inputs: Any) -> tuple[TilePlan, Analysis]:
        _, plan, analysis = self._build(inputs)
        return plan, analysis

    def _build(self, inputs: tuple) -> tuple[fx.GraphModule, TilePlan, Analysis]:
        key = self._key(inputs)
        held = self._held.bytes() if self.budget is not None and self.tiles is None else 0
        built = self._built.get(key)
        if built is None or held > built[3]:  # the step holds more than the plan counted: plan again
            self._built[key] = (*self._rewrite(inputs, self.extra + held), held)
        return self._built[key][:3]

    def _rewrite(self, inputs: tuple, extra: int) -> tuple[fx.GraphModule, TilePlan, Analysis]:
        gm = trace(self.model)  # a graph of its own to rewrite, calling the same modules
        tensors = tuple(t for t in tree_flatten(inputs)[0])
        analysis = analyze(gm, tensors)
        dev = self.device_profile
        lowp = any(isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16) for t in tensors)
        plan = plan_tiles(analysis.graph, self.budget, dev=dev, lowp=lowp, swapped=self.swapped, extra=extra,
                          tiles=self.tiles)  # fmt: skip
        say = progress_sink(self.progress, "swap.tiled")
        if say is not None:
            say(plan.describe(analysis.graph))
        graph = gm.graph
        replaced: dict[fx.Node, fx.Node] = {}
        for k, seg in enumerate(plan.segments):
            nodes = analysis.graph.nodes[seg.start : seg.end + 1]
            fxn = analysis.fx_nodes[seg.start : seg.end + 1]
            producer = analysis.fx_nodes[nodes[0].inputs[0]]
            producer = replaced.get(producer, producer)  # the previous segment's end, when segments touch
            steps = []
            prev = producer
            for node, fnode, rule in zip(nodes, fxn, analysis.rules[seg.start : seg.end + 1]):
                steps.append(Step(node.where, _call(fnode, rule, gm, prev), node.windows, rule.pad_value,
                                  _params(fnode, gm)))  # fmt: skip
                prev = fnode
            sizes = [[nodes[0].in_shape[2 + d]] + [n.out_shape[2 + d] for n in nodes] for d in range(len(seg.tiles))]
            device = None  # Note [Host inputs]: a model input only segments read may stay on the host
            seg_params = [p for s in steps for p in s.params]
            if self.swapped and producer.op == "placeholder" and seg_params:
                device = seg_params[0].device
            segment = TiledSegment(steps, seg.tiles, nodes[0].in_shape, nodes[-1].out_shape, sizes,
                                   analysis.dtypes[seg.end], copy_input=nodes[0].alias,
                                   progress=say if callable(self.progress) or seg.count >= 16 else None,
                                   device=device)  # fmt: skip
            name = f"tiled_segment_{k}"
            gm.add_submodule(name, segment)
            with graph.inserting_after(fxn[-1]):
                new = graph.call_module(name, (producer,))
            fxn[-1].replace_all_uses_with(new)
            replaced[fxn[-1]] = new
            for fnode in reversed(fxn):
                graph.erase_node(fnode)
        graph.lint()
        gm.recompile()
        return gm, plan, analysis

    def forward(self, *inputs: Any) -> Any:
        gm, plan, _ = self._build(inputs)
        self.last_plan = plan
        return gm(*inputs)
