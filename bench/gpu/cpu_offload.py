"""The baseline the model-state runtime is timed against: torchao's ``CPUOffloadOptimizer`` schedule, written here
because torchao is not installed on the lent GPU machines.

Note [CPU-offload baseline]
What torchao's CPUOffloadOptimizer (``offload_gradients=False``) does, and so what this does: the parameters
stay on the device and so do their gradients; each parameter has a pinned host copy and its own host AdamW
(``fused=True``, torchao's default for AdamW). When autograd has accumulated a parameter's gradient, a hook copies
it to pinned host memory on a side stream. ``step()`` waits for each parameter's copy in turn, steps its host
optimizer and copies the parameter back on the side stream; the compute stream waits for those copies before
the next forward. One difference, for correctness under gradient accumulation: the compute stream waits for
each gradient's copy before it can add the next micro-batch's gradient into the same memory (torchao leaves that
unordered). It holds weights and gradients on the device, unbounded by any budget: the results give its peak.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable


class CPUOffloadAdamW:
    """``make(params, **flags)`` builds the host optimizer of one parameter (``bench.gpu.model_state_gpu.adamw``)."""

    def __init__(self, model: Any, make: Callable[..., Any]) -> None:
        import torch

        self.params = [p for p in model.parameters() if p.requires_grad]
        self.cuda = self.params[0].is_cuda
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.host = []
        self.optims = []
        self.events: dict[int, Any] = {}
        self.hooks = []
        for p in self.params:
            h = torch.empty_like(p, device="cpu", pin_memory=self.cuda)
            h.copy_(p.detach())
            h.grad = torch.empty_like(h, pin_memory=self.cuda)
            self.host.append(h)
            self.optims.append(make([h], fused=True))
            self.hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready(len(self.host) - 1)))

    def _side(self) -> Any:
        import torch

        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _grad_ready(self, i: int) -> Callable[[Any], None]:
        import torch

        def hook(p: Any) -> None:
            if not self.cuda:
                self.host[i].grad.copy_(p.grad)
                return
            self.stream.wait_stream(torch.cuda.current_stream())
            with self._side():
                self.host[i].grad.copy_(p.grad, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.stream)
            torch.cuda.current_stream().wait_event(ev)  # the next micro-batch adds into p.grad after the copy
            self.events[i] = ev

        return hook

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        import torch

        if self.cuda:  # the copies back overwrite parameters the backward may still be reading
            self.stream.wait_stream(torch.cuda.current_stream())
        for i, (p, h, opt) in enumerate(zip(self.params, self.host, self.optims)):
            ev = self.events.pop(i, None)
            if ev is not None:
                ev.synchronize()
            opt.step()
            with torch.no_grad(), self._side():
                p.copy_(h, non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)

    def state_dict(self) -> dict[str, Any]:
        """One AdamW state dict over every parameter, in order (for the oracle's comparison)."""
        state = {}
        for i, opt in enumerate(self.optims):
            sd = opt.state_dict()["state"]
            if 0 in sd:
                state[i] = sd[0]
        return {"state": state}

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
