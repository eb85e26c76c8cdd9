"""DDP with ``model=``/``optimizer=`` on two gloo ranks: refused at entry, naming DDP and FSDP2's path (Note [Model
state under DDP]); before, the gradient hook took each gradient ahead of DDP's reducer and the ranks diverged
silently. A model wrapped in DDP after the manager started (as the HF Trainer and accelerate do under torchrun) is
refused at its first forward under DDP (Note [DDP that wraps the model later])."""

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[3]


def _rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    try:
        import swap

        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
        ddp = nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        outcome = []
        for model in (ddp, nn.ModuleDict({"wrapped": ddp})):
            try:
                swap.SwapManager(budget="1GiB", device="cpu", model=model, optimizer=opt)
                outcome.append("ACCEPTED")
            except ValueError as e:
                outcome.append(str(e))
        # Kept on the device, the model state is DDP's own: the manager is built (activations only).
        swap.SwapManager(budget="1GiB", device="cpu", model=ddp, optimizer=opt,
                         model_state=swap.ModelStatePolicy(placement="resident"))
        Path(out_dir, f"{rank}.txt").write_text("\n".join(outcome))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent through the file
        Path(out_dir, f"{rank}.txt").write_text("ERROR " + traceback.format_exc())


def test_offloaded_model_state_under_ddp_is_refused_at_entry(tmp_path):
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    mp.spawn(_rank, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        messages = (tmp_path / f"{rank}.txt").read_text().split("\n")
        assert len(messages) == 2, messages
        for message in messages:
            assert "DistributedDataParallel" in message and "FSDP2" in message, message
            assert "placement='resident'" in message


def _late_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    try:
        import swap

        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        outcome = "ACCEPTED"
        with swap.SwapManager(budget="1GiB", device="cpu", model=net, optimizer=opt):
            net(torch.randn(8, 32)).sum().backward()  # unwrapped: trains
            opt.step()
            ddp = nn.parallel.DistributedDataParallel(net)  # what a trainer's train() does under torchrun
            try:
                ddp(torch.randn(8, 32)).sum().backward()
            except ValueError as e:
                outcome = str(e)
        Path(out_dir, f"{rank}.txt").write_text(outcome)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent through the file
        Path(out_dir, f"{rank}.txt").write_text("ERROR " + traceback.format_exc())


def test_a_model_wrapped_in_ddp_after_the_manager_started_is_refused_at_its_forward(tmp_path):
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    mp.spawn(_late_rank, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        message = (tmp_path / f"{rank}.txt").read_text()
        assert "after the manager started" in message and "FSDP2" in message, message
