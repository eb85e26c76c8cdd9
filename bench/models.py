"""The built-in models now live in the library (``swap.zoo``: ``python -m swap.plan --model NAME`` needs
them without the benchmarks); this name stays for the benchmarks' and tests' imports."""

from swap.zoo import (  # noqa: F401 - re-exported
    GPT,
    ZOO,
    DenseNet,
    ResNet,
    UNet,
    Workload,
    densenet,
    densenet121,
    example_batch,
    gpt,
    gpt2,
    gpt2_medium,
    loss_fn,
    resnet,
    resnet50,
    unet,
)
