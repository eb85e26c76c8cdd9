"""Loops that kept the budget only by the manager's own meter (issue 36 item 8): judged here by the sweep meter
(tests/swap/sweep_meter.py), which re-reads every storage any operator reads or returns, at the budget the loops
suite uses (halfway between the weights and plain training's peak), with the default strategy.

- Clipping and loss scaling run the runtime's own operators on the host gradient buffers (Note [Host operators
  unseen] in swap/runtime/model_state/clipping.py): no meter of the device may see those buffers.
- An evaluation between optimizer steps fetches and drops every bucket in the iteration's last interval (Note [A
  held tensor freed mid-step] in swap/runtime/activations/residency.py): the profile must not count each drop as
  held."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Callable, Optional

import torch
from ms_loops import Step, assert_same, batch, gpt, loss_of, plain_step, run, within

import swap

sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests/swap: sweep_meter
from sweep_meter import SweepMeter  # noqa: E402

ITERS = 4  # two profiled, two planned


def weight_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in gpt().parameters())


@functools.cache
def plain(loop: str) -> tuple[dict, int]:
    """Plain training's run of ``loop`` and the budget: halfway between the weights and its peak."""
    meter = swap.LiveBytesMeter("cpu")
    ref = run(gpt, LOOPS[loop](), iters=ITERS, meter=meter)
    return ref, (weight_bytes() + max(ref["peaks"])) // 2


def scaled_clip() -> Step:
    """GradScaler's unscale, torch's clipping with the norm logged, a gradient assigned by hand."""
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer, it: int, log: dict[str, list]) -> None:
        opt.zero_grad()
        x, y = batch(it)
        loss = loss_of(model, x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        log.setdefault("norm", []).append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        last = list(model.parameters())[-1]
        last.grad = torch.full_like(last, 1e-3)  # a write of p.grad: into its host buffer
        scaler.step(opt)
        scaler.update()
        log["loss"].append(loss.item())

    return step


def evaluating() -> Step:
    """A training step, then an evaluation over three held-out batches."""

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer, it: int, log: dict[str, list]) -> None:
        plain_step(model, opt, it, log)
        model.eval()
        with torch.no_grad():
            for k in range(3):
                x, y = batch(1000 + 10 * it + k)
                log.setdefault("eval", []).append(loss_of(model, x, y).item())
        model.train()

    return step


LOOPS: dict[str, Callable[[], Step]] = {"scaled_clip": scaled_clip, "eval": evaluating}


def managed(loop: str, budget: int, after: Optional[Callable[[swap.SwapManager, SweepMeter], None]] = None) -> dict:
    """``loop`` inside ``SwapManager(budget=, model=, optimizer=)`` (every other setting its default), judged by a
    sweep meter; ``after(manager, meter)`` runs after each iteration."""
    meter, managers = SweepMeter("cpu"), []
    inner = LOOPS[loop]()

    def make(model: torch.nn.Module, opt: torch.optim.Optimizer) -> swap.SwapManager:
        managers.append(swap.SwapManager(budget=budget, device="cpu", model=model, optimizer=opt))
        return managers[0]

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer, it: int, log: dict[str, list]) -> None:
        inner(model, opt, it, log)
        if after is not None:
            after(managers[0], meter)

    return run(gpt, step, iters=ITERS, manager=make, meter=meter)


def test_clipping_and_unscaling_never_show_a_host_gradient_buffer_to_a_meter() -> None:
    ref, budget = plain("scaled_clip")
    seen: list[int] = []

    def count(sm: swap.SwapManager, meter: SweepMeter) -> None:
        hosts = {id(h.untyped_storage()) for h in sm.model_state.grads.host.values()}
        seen.append(sum(1 for key, r in meter._storages.items() if key in hosts and r() is not None))

    got = managed("scaled_clip", budget, after=count)
    assert seen == [0] * ITERS, f"host gradient buffers the device's meter counted, by iteration: {seen}"
    assert_same(ref, got)
    within(got, budget)


def test_an_evaluation_between_steps_trains_within_the_budget() -> None:
    ref, budget = plain("eval")
    assert budget < max(ref["peaks"])
    got = managed("eval", budget)
    assert_same(ref, got)
    within(got, budget)
