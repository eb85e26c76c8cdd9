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


def _ranked(rank: int, case: str, world: int, init_file: str, out_dir: str) -> None:
    """Runs ``CASES[case]`` on gloo rank ``rank`` and writes what it returned (or its traceback) for the parent."""
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        torch.manual_seed(0)
        outcome = CASES[case](nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)))
        Path(out_dir, f"{rank}.txt").write_text(outcome)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent through the file
        Path(out_dir, f"{rank}.txt").write_text("ERROR " + traceback.format_exc())


def on_two_ranks(case: str, tmp_path: Path) -> list[str]:
    """What ``CASES[case]`` returned on each of two gloo ranks."""
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    mp.spawn(_ranked, args=(case, 2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    return [(tmp_path / f"{rank}.txt").read_text() for rank in range(2)]


def given_ddp(net: nn.Module) -> str:
    """The manager given a DDP model, bare and inside a container: the two refusals, one a line."""
    import swap

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
                     model_state=swap.ModelStatePolicy(placement="resident"))  # fmt: skip
    return "\n".join(outcome)


def wrapped_later(net: nn.Module) -> str:
    """The manager given the bare model, which DDP wraps inside the manager: the refusal at DDP's forward."""
    import swap

    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with swap.SwapManager(budget="1GiB", device="cpu", model=net, optimizer=opt):
        net(torch.randn(8, 32)).sum().backward()  # unwrapped: trains
        opt.step()
        ddp = nn.parallel.DistributedDataParallel(net)  # what a trainer's train() does under torchrun
        try:
            ddp(torch.randn(8, 32)).sum().backward()
        except ValueError as e:
            return str(e)
    return "ACCEPTED"


CASES = {"given_ddp": given_ddp, "wrapped_later": wrapped_later}


def test_offloaded_model_state_under_ddp_is_refused_at_entry(tmp_path):
    for text in on_two_ranks("given_ddp", tmp_path):
        messages = text.split("\n")
        assert len(messages) == 2, messages
        for message in messages:
            assert "DistributedDataParallel" in message and "FSDP2" in message, message
            assert "placement='resident'" in message


def test_a_model_wrapped_in_ddp_after_the_manager_started_is_refused_at_its_forward(tmp_path):
    for message in on_two_ranks("wrapped_later", tmp_path):
        assert "after the manager started" in message and "FSDP2" in message, message
