"""Train a small CNN for a few steps and print the losses (repr, so equality is bitwise).

python train_small.py [vmalloc|vmalloc_pool|default]
"""

import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from torch import nn  # noqa: E402

mode = sys.argv[1]
if mode == "vmalloc":
    import vmalloc

    torch.cuda.memory.change_current_allocator(vmalloc.allocator(capacity="8GiB"))

torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
torch.backends.cudnn.benchmark = False


def build():
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    ).cuda()


def train():
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(5):
        x = torch.randn(64, 3, 32, 32, generator=g).cuda()
        y = torch.randint(0, 10, (64,), generator=g).cuda()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


if mode == "vmalloc_pool":
    import vmalloc

    pool = vmalloc.mem_pool()
    with torch.cuda.use_mem_pool(pool):
        losses = train()
else:
    losses = train()
print(repr(losses))
if mode.startswith("vmalloc"):
    import vmalloc

    s = vmalloc.stats(0)
    assert s["num_alloc"] > 0 and s["reserved_bytes.all.peak"] <= s["capacity"], s
    torch.cuda.empty_cache()  # reset hook (global mode) -> vmalloc empty_cache
    print("STATS", s["num_alloc"], s["reserved_bytes.all.peak"], s["num_maps"])
