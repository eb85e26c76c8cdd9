"""The signals the runtime gives while training goes on."""

from __future__ import annotations


class BudgetWarning(UserWarning):
    """The swap runtime could not keep the budget, or had nothing to do: nothing could be swapped, the
    budget was exceeded because of ``min_bytes``, ``exclude`` or a device mismatch, or an iteration measured
    more than it was planned for. Each cause is warned about once per manager."""


class WholeModelCompiled(RuntimeError):
    """Saved tensors come from a torch.compile'd region that is the whole model (or the whole step).

    Note [Hooks and torch.compile]
    A compiled region is one autograd Function: autograd saves what it keeps for backward when its forward
    returns, and its backward takes all of it at once. Swapping acts at region boundaries, so it works for
    regional compile (each block compiled: torch.compile(block), or Module.compile on a user-defined
    block), and can do nothing when the region is the whole model. The hooks themselves are excluded from
    tracing (torch._dynamo.disable): dynamo would otherwise try to trace them into the region, and break
    the graph at each saved tensor.

    What counts as the whole model (profiling, from the stack: ModulePaths):
    - a region that is the outermost module's forward (torch.compile(model), model.compile()): refused at
      its first saved tensor;
    - a region outside any module (a compiled function) is the whole model only if the model's forward is
      in it, i.e. a compiled training step: then no tensor of the iteration was saved inside a module. That
      is known once the forward is over, so it is refused at the backward's first unpack. A compiled loss
      or any other small compiled function next to an eager (or regionally compiled) model is swapped as
      usual."""

    def __init__(self) -> None:
        super().__init__(
            "swap: the model is compiled as a whole (torch.compile(model), or a compiled training step): autograd "
            "saves every activation at once when the compiled forward returns, and the compiled backward takes "
            "them all at once, so swapping cannot lower any peak. Use regional compile instead: compile each "
            "block (model.layers[i] = torch.compile(model.layers[i]), or block.compile() for your own block "
            "classes), so the saved tensors are swapped at block boundaries; or use the compiler's own activation "
            "offloading instead of swap.SwapManager."
        )
