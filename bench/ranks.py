"""Run a function on several CPU processes joined by a gloo process group (torch.multiprocessing, spawn), and
collect what each rank returns: the benchmarks and tests of FSDP2 under the manager use it."""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def spawn(worker: Callable[[int, str], Any], tmp: Optional[Path] = None, world: int = 2,
          threads: int = 1) -> list[Any]:  # fmt: skip
    """Runs ``worker(rank, tmp)`` on ``world`` gloo ranks (``threads`` compute threads each; a picklable,
    importable function); returns each rank's result, or raises with the first failing rank's traceback."""
    tmp = Path(tempfile.mkdtemp(prefix="ranks-")) if tmp is None else Path(tmp)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    mp.spawn(_run, args=(world, worker, str(tmp), threads), nprocs=world, join=True)
    results = []
    for rank in range(world):
        got = pickle.loads(Path(tmp, f"{rank}.pkl").read_bytes())
        if isinstance(got, _Failed):
            raise AssertionError(f"rank {rank} failed:\n{got.text}")
        results.append(got)
    return results


class _Failed:
    def __init__(self, text: str) -> None:
        self.text = text


def _run(rank: int, world: int, worker: Callable[[int, str], Any], tmp: str, threads: int) -> None:
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
        try:
            result: Any = worker(rank, tmp)
        finally:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent through the file
        result = _Failed(traceback.format_exc())
    Path(tmp, f"{rank}.pkl").write_bytes(pickle.dumps(result))
