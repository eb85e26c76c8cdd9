"""DDP with two CPU processes (gloo): gradients with swapping equal those without."""

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

HERE = Path(__file__).resolve().parent


def _train(rank: int, use_swap: bool) -> list[torch.Tensor]:
    import swap

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)], nn.Linear(256, 4))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = []
    manager = swap.SwapManager(budget="64GiB", device="cpu", min_bytes=0, policy="all") if use_swap else None
    if manager:
        manager.__enter__()
    try:
        for it in range(4):
            g = torch.Generator().manual_seed(100 * rank + it)
            x, y = torch.randn(512, 256, generator=g), torch.randint(0, 4, (512,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            grads += [p.grad.clone() for p in model.parameters()]
            opt.step()
    finally:
        if manager:
            manager.__exit__(None, None, None)
    if manager:
        assert manager.report()["swapped_out_bytes"] > 0
    return grads


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        plain, swapped = _train(rank, False), _train(rank, True)
        same = all(torch.equal(a, b) for a, b in zip(plain, swapped))
        Path(out_dir, f"{rank}.txt").write_text("OK" if same else "DIFFERENT")
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent through the file
        Path(out_dir, f"{rank}.txt").write_text(traceback.format_exc())


def test_ddp_gradients_match_with_and_without_swap(tmp_path):
    sys.path.insert(0, str(HERE.parents[1]))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        assert (tmp_path / f"{rank}.txt").read_text() == "OK"
