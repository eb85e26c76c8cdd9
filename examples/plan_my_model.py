"""A model of your own, planned before you buy memory:

    python -m swap.plan --model examples/plan_my_model.py:model_fn --batch examples/plan_my_model.py:batch_fn \
        --budget 24GiB --device h100-pcie

``model_fn()`` builds the model (``swap.plan`` calls it on the meta device: no memory, no weights loaded),
``batch_fn(n)`` returns a batch of n samples the way your data loader would. Here: GPT-2 small (124 M
parameters) from Hugging Face transformers, trained on 1024-token sequences with its own loss (labels in the
batch); the optimizer is AdamW unless ``--optimizer`` says otherwise.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

SEQ_LEN = 1024


def model_fn() -> torch.nn.Module:
    return GPT2LMHeadModel(GPT2Config(n_positions=SEQ_LEN))


def batch_fn(n: int) -> dict:
    tokens = torch.randint(0, 50257, (n, SEQ_LEN))
    return {"input_ids": tokens, "labels": tokens}
