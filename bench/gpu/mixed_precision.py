"""The model-state bench's mixed precision, written out by hand: fp32 masters, compute copies in bf16, each
backward's gradient upcast and accumulated in fp32 (``bench.gpu.model_state_gpu --fp32-masters``).

Note [The bench's mixed-precision oracle]
``SwapManager(compute_dtype=torch.bfloat16)`` trains in the format of Note [Mixed precision]
(swap/runtime/model_state/precision.py), and the bench's oracle and plain runs must train in the same one, step for
step, or nothing can be compared bit for bit. This is the reference loop of
tests/swap/model_state/test_ms_mixed_precision.py (itself FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` on one rank, bitwise):

- the masters are fp32 copies of the fp32 parameters, on ``master_device`` (the host for the oracle, the device
  for plain training); the optimizer steps the masters;
- each model parameter becomes its compute copy: its master cast to ``compute_dtype`` (round to nearest even), on
  the device, and again after every optimizer step (``publish``);
- after each micro-batch's backward (``accumulate``) its gradient, in ``compute_dtype``, is upcast to fp32 and
  added to the master's fp32 gradient (the first backward of a step copies it), and the compute gradient is
  dropped, so micro-batches accumulate in fp32, never in bf16;
- the token ids are integers: no input cast is needed (the runtime casts floating-point inputs only).
The final parameters and AdamW state the bench digests are the masters' (the runtime's parameters are its fp32
masters again after the manager).
"""

from __future__ import annotations

from typing import Any


class MixedPrecision:
    """fp32 masters of ``model``'s parameters on ``master_device``; the parameters become ``compute_dtype`` copies
    (Note [The bench's mixed-precision oracle]). Give ``masters`` to the optimizer."""

    def __init__(self, model: Any, master_device: Any, compute_dtype: Any) -> None:
        import torch

        self.params = list(model.parameters())
        if any(p.dtype != torch.float32 for p in self.params):
            raise ValueError("MixedPrecision keeps fp32 masters: build the model in fp32")
        self.masters = [p.detach().to(master_device, copy=True) for p in self.params]
        for p in self.params:
            p.data = p.data.to(compute_dtype)

    def accumulate(self) -> None:
        """After each backward: compute gradients upcast to fp32 and added to the masters'; compute ones dropped."""
        import torch

        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                continue
            g = p.grad.to(m.device, torch.float32)
            m.grad = g if m.grad is None else m.grad.add_(g)
            p.grad = None

    def publish(self) -> None:
        """After the optimizer step: the compute copies cast again from the masters."""
        import torch

        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
