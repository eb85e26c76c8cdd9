"""What the parameter guard (Note [Parameter guard] in swap/runtime/model_state/guard.py) costs per operator on CPU.

    python -m bench.guard_cost            # 7 rounds of 20,000 operators each (under a minute)
    python -m bench.guard_cost --quick    # a smoke run

Issue 36 (item 11) put the guard at ~19 us per operator for the whole run. Here a loop of tiny operators
(``torch.add`` of two 8-element tensors: the kernel is next to nothing, so what is timed is the dispatch) runs under:

- ``plain``: no dispatch mode;
- ``null mode``: an empty TorchDispatchMode, the floor of any Python dispatch mode;
- ``guard, nothing watched``: the guard with an empty ``watched`` map (its per-operator scan of the arguments);
- ``guard, 1,000 watched``: the same with a thousand storages watched, none of them the operator's (every
  operator of a forward that touches no weight);
- ``guard, a weight read``: the operator's first argument is a watched storage, not dropped (the guard asks
  ``ready`` and ``written_args``, every operator of a module's forward on its weight).

Times are CPU time of the calling thread (Note [CPU time, not wall time] in bench/swap_overhead.py), per operator,
min and median over the rounds. Writes <out>/guard_cost.json and guard_cost.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from swap.runtime.model_state.guard import ParamGuard


class NullMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        return func(*args, **(kwargs or {}))


def per_op(ops: int, mode: Any, a: torch.Tensor, b: torch.Tensor) -> float:
    """Seconds of this thread's CPU time per ``torch.add(a, b)`` under ``mode`` (None: none)."""
    if mode is not None:
        mode.__enter__()
    try:
        t0 = time.thread_time()
        for _ in range(ops):
            torch.add(a, b)
        return (time.thread_time() - t0) / ops
    finally:
        if mode is not None:
            mode.__exit__(None, None, None)


def guard(watched: dict[int, Any]) -> ParamGuard:
    return ParamGuard(watched, dropped=lambda key: False, demand=lambda key: None, wrote=lambda key: None)


def cases() -> dict[str, Callable[[], tuple[Any, torch.Tensor, torch.Tensor]]]:
    a, b = torch.ones(8), torch.ones(8)
    others = [torch.zeros(1) for _ in range(1000)]
    many = {t.untyped_storage()._cdata: k for k, t in enumerate(others)}
    weight = torch.ones(8)
    read = {**many, weight.untyped_storage()._cdata: -1}
    return {
        "plain": lambda: (None, a, b),
        "null mode": lambda: (NullMode(), a, b),
        "guard, nothing watched": lambda: (guard({}), a, b),
        "guard, 1,000 watched": lambda: (guard(many), a, b),
        "guard, a weight read": lambda: (guard(read), weight, b),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    rounds, ops = (2, 2000) if args.quick else (7, 20000)
    torch.set_num_threads(1)
    made = cases()
    seconds: dict[str, list[float]] = {name: [] for name in made}
    for _ in range(rounds):
        for name, make in made.items():
            mode, a, b = make()
            per_op(ops // 10, mode, a, b)  # warm-up
            seconds[name].append(per_op(ops, mode, a, b))
    rows = {name: {"min_us": min(s) * 1e6, "median_us": statistics.median(s) * 1e6} for name, s in seconds.items()}
    floor = rows["null mode"]["min_us"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "python": platform.python_version(), "rounds": rounds, "ops": ops}
    (out / "guard_cost.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [
        "# The parameter guard's cost per operator (CPU)",
        "",
        f"`python -m bench.guard_cost` (torch {meta['torch']}, {rounds} rounds of {ops} `torch.add` on 8 elements, "
        "CPU time of the calling thread per operator; Note [CPU time, not wall time]).",
        "",
        "| case | min (us) | median (us) | over the null mode, min (us) |",
        "|---|---|---|---|",
    ]
    for name, r in rows.items():
        extra = "" if name == "plain" else f"{r['min_us'] - floor:+.2f}"
        lines.append(f"| {name} | {r['min_us']:.2f} | {r['median_us']:.2f} | {extra} |")
    (out / "guard_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
