"""Model state under the budget: the user's parameters, gradients and optimizer state placed and updated by the
runtime (``SwapManager(model=, optimizer=)`` on one device; ``fsdp2`` and ``fsdp2_steps`` for a rank of FSDP2);
``runtime`` wires the parts."""
