"""swap with the trainers people use. Most need no helper: the swap runtime hooks autograd, so wrapping the
call that trains is the whole recipe (README, "swap with your trainer"):

- a plain loop, or Hugging Face ``Trainer``: ``with swap.SwapManager(budget=...) as sm: trainer.train()``;
- ``accelerate.find_executable_batch_size``: ``torch_oom()`` makes swap's InfeasibleBudget and vmalloc's
  OutOfMemoryError the out-of-memory error accelerate reduces the batch on (``swap.integrations.oom``);
- PyTorch Lightning: ``with swap.SwapManager(...): trainer.fit(model)``, or, where something else calls
  ``fit`` (LightningCLI), the ``SwapCallback`` of ``swap.integrations.lightning``.

Each integration imports its framework only when imported itself: ``import swap`` needs none of them.
"""
