"""The tiled VGG-style CNN of test_tiled_budget, judged by the independent sweep meter (Note [Sweeping every
storage], tests/swap/sweep_meter.py) that re-reads every live storage's size at each operator: every iteration
within the budget, and the tiled model's own meter (swap.LiveBytesMeter) within 1 % of it."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import torch
from test_tiled_budget import train_step, vgg_style

import swap

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sweep_meter import SweepMeter  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def test_a_tiled_cnn_is_within_its_budget_by_the_sweep_meter() -> None:
    """Trains in a fresh interpreter (this file run as a script).

    Note [The sweep test in its own process]
    The sweep meter re-reads every storage it has seen at each of the tiled training's ~29,000 operators, and
    ``track_existing`` sees every tensor the process holds: in a whole-suite run that is every earlier test's
    leftovers too (316 MB of them once), and the sweeps over them made this test take 365 s of a 1,502 s suite,
    against 107 s of CPU alone. A fresh interpreter holds only the training's storages; what the test asserts
    is the same (foreign and unseen bytes are ~0 there and still accounted).
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-6000:]}"


def train_and_sweep() -> None:
    """The check itself: an AssertionError (or any error) when the tiled training is not within its budget."""
    gc.collect()
    live = swap.LiveBytesMeter()
    with live.track_existing():
        foreign = live.live  # what earlier tests keep alive: the caller's extra
    torch.manual_seed(0)
    model = vgg_style()
    x, y = torch.randn(1, 3, 256, 256), torch.tensor([1])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with live.track_existing():
        train_step(model, opt, x, y)
        static = live.live
        live.reset_window()
        train_step(model, opt, x, y)
        untiled = live.reset_window()
    budget = int(static + 0.1 * (untiled - static))
    opt.zero_grad(set_to_none=True)
    tiled = swap.tiled(model, budget=budget, extra=foreign)
    gc.collect()
    sweep, peaks, own = SweepMeter().track_existing(), [], []
    # Storages earlier tests of the same process keep alive that the sweep meter finds and LiveBytesMeter's walk
    # (whose count the caller's extra is) does not: not the training's, so not held against its budget.
    now = swap.LiveBytesMeter()
    with now.track_existing():
        unseen = max(0, sweep.sweep() - now.live)
    with live.track_existing(), sweep:
        for _ in range(2):
            sweep.reset_window()
            live.reset_window()
            train_step(tiled, opt, x, y)
            peaks.append(sweep.reset_window() - unseen)
            own.append(live.reset_window())
    assert max(peaks) <= budget, f"peaks by the sweep meter {peaks} (less {unseen} B alive before that only it " \
        f"sees) over the budget {budget} (own meter: {own})"
    assert all(abs(a - b) <= 0.01 * a for a, b in zip(peaks, own)), (peaks, own)


if __name__ == "__main__":
    train_and_sweep()
