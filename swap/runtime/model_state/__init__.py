"""Model state under the budget: the user's parameters, gradients and optimizer state placed and updated by the
runtime (``SwapManager(model=, optimizer=)``); ``runtime`` wires the parts."""
