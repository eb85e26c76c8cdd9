"""Recompute regions time their reruns without keeping a pair of timer marks (CUDA events on a GPU) per rerun
for the life of the run, and the report waits only for reruns still in flight (Note [Rerun timing])."""

import sys
from pathlib import Path

import torch
import torch.nn as nn

import swap
from swap.joint.regions import RecomputePlan, Region
from swap.joint.search import JointResult, Strategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training import run, standard  # noqa: E402


def blocks() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3)])


def batch(model, it):  # 64 classes: the standard pattern's cross entropy on the last block's 64 features
    g = torch.Generator().manual_seed(it)
    return torch.randn(256, 64, generator=g), torch.randint(0, 64, (256,), generator=g)


def checkpoint_first_block(ev):
    plan = RecomputePlan((Region("0"),))
    return JointResult(ev.evaluate(Strategy("region 0", plan, "window")), {}, ev.evaluations)


class DeviceTimer:
    """Marks that finish when the test says (as CUDA events do when the device gets there); ``resolve`` of an
    unfinished one is a host wait, counted."""

    def __init__(self):
        self.marks, self.waits = [], 0

    def start(self):
        pass

    def stop(self):
        mark = {"done": False}
        self.marks.append(mark)
        return mark

    def done(self, mark):
        return mark["done"]

    def resolve(self, mark):
        if not mark["done"]:
            self.waits += 1
            mark["done"] = True
        return 0.5


def peak() -> int:
    return max(run("blocks", 2, meter=swap.LiveBytesMeter("cpu"), build=blocks, batch_fn=batch)["peaks"])


def manager(budget: int) -> swap.SwapManager:
    sm = swap.SwapManager(budget=budget, device="cpu", min_bytes=0)
    sm._joint.choose = checkpoint_first_block
    return sm


def train(sm, iterations, each=lambda it: None, timer=None):
    with sm:
        if timer is not None:
            sm._joint.regions.timer = timer
        torch.manual_seed(0)
        model = blocks()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for it in range(iterations):
            x, y = batch(model, it)
            standard(model, x, y, it)
            opt.step()
            opt.zero_grad()
            each(it)
    return sm


def test_rerun_marks_do_not_accumulate():
    sm = train(manager(int(0.75 * peak())), 12)
    stats = sm.joint_view.regions.get("0")
    assert stats is not None and stats.reruns >= 8
    assert len(stats.rerun_marks) <= 1, f"{len(stats.rerun_marks)} marks kept after {stats.reruns} reruns"
    row = next(r for r in sm.report()["modules"] if r["module"] == "0")
    assert row["recompute_seconds"] > 0


def test_finished_reruns_are_folded_and_the_report_waits_only_for_those_in_flight():
    timer = DeviceTimer()

    def device_catches_up(it):  # the device finishes everything but the last iteration's rerun
        for mark in timer.marks[:-1]:
            mark["done"] = True

    sm = train(manager(int(0.75 * peak())), 12, device_catches_up, timer)
    stats = sm.joint_view.regions["0"]
    assert stats.reruns >= 8 and len(timer.marks) == stats.reruns
    assert len(stats.rerun_marks) <= 2
    row = next(r for r in sm.report()["modules"] if r["module"] == "0")
    assert row["recompute_seconds"] == 0.5 * stats.reruns
    assert timer.waits <= 1, f"the report waited for {timer.waits} finished reruns"


def test_the_reference_run_is_unchanged():
    ref = run("blocks", 4, meter=swap.LiveBytesMeter("cpu"), build=blocks, batch_fn=batch)
    budget = int(0.75 * max(ref["peaks"]))
    got = run("blocks", 4, manager=lambda: manager(budget), build=blocks, batch_fn=batch)
    assert ref["losses"] == got["losses"]
    assert got["manager"].joint_view.regions["0"].reruns >= 1
