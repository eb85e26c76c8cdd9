"""No module in swap/ reads another object's private attributes: the runtime's objects talk through typed,
public interfaces. Checked on the source tree: every ``<expr>._name`` (and ``getattr(<expr>, "_name")``) where
``<expr>`` is not ``self`` or ``cls`` fails the test, except dunders and the private names of torch and the
standard library that swap has to use, each listed below with why. A name listed there passes on any object, so
give a project attribute none of these names."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Private names of torch and the standard library that swap has to use -> why.
ALLOWED = {
    # torch's modules and C bindings, reached through the torch module
    "_C": "torch's C extension: autograd state, storage use counts and dispatch guards have no public name",
    "_autograd": "torch._C._autograd: the innermost saved-tensor hooks and the autograd sequence number",
    "_dynamo": "torch._dynamo.disable: the saved-tensor hooks must run eagerly, never be traced",
    "_DisableTorchDispatch": "views and copies made with Python dispatch off, unseen by a dispatch mode (the meter)",
    "_storage_Use_Count": "whether anything but the capture holds a storage",
    "_current_autograd_node": "the backward node running now (uses by one node share a group)",
    "_current_graph_task_id": "whether this thread runs a backward pass",
    "_top_saved_tensors_default_hooks": "whether the innermost saved-tensor hooks are the manager's",
    "_get_sequence_nr": "the autograd sequence number, to order saved tensors' producers",
    "_execution_engine": "autograd's engine, to queue a callback at the end of a backward pass",
    "_call_impl": "nn.Module's call frame, to read the running module's path from the stack",
    "_orig_mod": "the module a torch.compile wrapper (OptimizedModule) wraps",
    "_get_foreach_kernels_supported_devices": "torch.optim's device list for foreach kernels (meta-device capture)",
    "_destroy": "torch.library.Library has no public way to drop its registrations",
    "_assert_async": "a check queued on the device, with no host sync (the tiled head's label check on CUDA)",
    "_clip_grads_with_norm_": "the helper torch's clip_grad_norm_ looks up at call time: a copy of clip_grad_norm_ "
    "imported before the manager must refuse, not leave the host gradients out (Note [Exact clipping])",
    "_unscale_grads_": "GradScaler's per-optimizer unscale pass, routed so it also unscales host gradients and "
    "folds their inf check into the device's flag (Note [Unscaling host gradients]); it has no public hook",
    "_amp_foreach_non_finite_check_and_unscale_": "the kernel GradScaler unscales with, so host gradients are "
    "unscaled and checked exactly as the device's are",
    "_get_fsdp_state": "an FSDP2 module's state: every path that unshards a unit ends in its parameter group's "
    "unshard, which has no public hook (Note [Every unshard gated])",
    "_get_active_ddp_module": "the DDP module whose forward runs now (the classmethod TorchDynamo reads): a model "
    "wrapped in DDP after the manager started is refused at its forward (Note [DDP that wraps the model later])",
    "_fsdp_param_group": "the FSDP2 state's parameter group, whose unshard is gated (Note [Every unshard gated])",
    # tensors, storages, operators and autograd nodes
    "_base": "a view's base tensor (parameters are recognised through their views)",
    "_version": "a tensor's version counter: in-place writes to saved tensors are detected with it",
    "_is_view": "whether a tensor is a view",
    "_cdata": "a storage's C pointer, its identity across Python wrappers",
    "_schema": "an operator's schema (its arguments, which of them it writes)",
    "_overloadpacket": "an operator's overload packet (its name without the overload)",
    "_sequence_nr": "an autograd node's sequence number",
    # the standard library
    "_getframe": "sys._getframe: the module path is read from the Python stack, only when profiling",
    "_fields": "a NamedTuple's field names: documented public API despite the underscore",
}
# Prefixes of private names -> why.
ALLOWED_PREFIXES = {
    "_saved_": "an autograd node's saved values (the inputs and arguments of a rebuild)",
}


def allowed(name: str, base: ast.expr) -> bool:
    if name.startswith("__") and name.endswith("__"):
        return True
    if name in ALLOWED or any(name.startswith(p) for p in ALLOWED_PREFIXES):
        return True
    # aten operators whose names begin with an underscore: torch.ops.aten._x or aten._x (public op names)
    last = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
    return last == "aten"


def own(base: ast.expr) -> bool:
    return isinstance(base, ast.Name) and base.id in ("self", "cls")


def private_reads(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, expression) of every read of another object's private attribute in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if not own(node.value) and not allowed(node.attr, node.value):
                found.append((node.lineno, node.col_offset, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and node.args[1].value.startswith("_")
        ):
            if not own(node.args[0]) and not allowed(node.args[1].value, node.args[0]):
                found.append((node.lineno, node.col_offset, ast.unparse(node)))
    return [(line, expr) for line, _, expr in sorted(found)]


def test_the_scan_finds_private_reads():
    src = (
        "class A:\n"
        "    def f(self, other):\n"
        "        self._mine = other._theirs\n"
        "        return getattr(other, '_hidden', None), torch._C, t._version, cls_like._x, type(self).__name__\n"
    )
    assert [e for _, e in private_reads(src)] == ["other._theirs", "getattr(other, '_hidden', None)", "cls_like._x"]


def test_no_module_in_swap_reads_another_objects_private_attributes():
    bad = []
    for path in sorted((ROOT / "swap").rglob("*.py")):
        for line, expr in private_reads(path.read_text(), str(path)):
            bad.append(f"{path.relative_to(ROOT)}:{line}: {expr}")
    assert not bad, "reads of other objects' private attributes (give the owner a public name):\n" + "\n".join(bad)
