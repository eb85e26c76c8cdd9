"""DDP with ``model=``/``optimizer=`` on two gloo ranks: refused at entry, naming DDP and FSDP2's path (Note [Model
state under DDP]); before, the gradient hook took each gradient ahead of DDP's reducer and the ranks diverged
silently."""

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
