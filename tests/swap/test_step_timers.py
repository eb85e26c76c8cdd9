"""The CUDA step timer takes the operator profiler's bookkeeping out of an interval when the device had caught up
with the host (it idled while the host did it), and keeps the interval whole when the device had not begun it
(the bookkeeping hid behind the device's queue): Note [Our own time is not the model's] in
swap/runtime/machine/timers.py. The events are stand-ins with a scripted device clock; no GPU is needed."""

import pytest
import torch

from swap.runtime.machine.timers import CudaStepTimer, interval_seconds


class FakeEvent:
    """A recorded CUDA event: when the device runs it (``at``, seconds on the device clock) and whether it has
    run by the host's next question (``ran``)."""

    def __init__(self, at: float, ran: bool) -> None:
        self.at, self.ran = at, ran

    def query(self) -> bool:
        return self.ran

    def synchronize(self) -> None:
        self.ran = True

    def elapsed_time(self, end: "FakeEvent") -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as torch.cuda.Event's


class ScriptedTimer(CudaStepTimer):
    """Each recorded event takes the next (device time, run by the next query) from ``script``."""

    def __init__(self, script: list[tuple[float, bool]]) -> None:
        super().__init__(torch.device("cuda", 0))
        self.script = list(script)

    def _event(self) -> FakeEvent:
        return FakeEvent(*self.script.pop(0))


def measure(script: list[tuple[float, bool]], bookkeeping: float) -> float:
    timer = ScriptedTimer(script)
    timer.start()
    timer.exclude(bookkeeping)
    return timer.resolve(timer.stop())


def test_a_starved_device_has_the_bookkeeping_taken_out_though_it_measured_longer_than_the_host():
    # The host spends 300 us in the interval, 250 of them the profiler's bookkeeping; the device ran the start
    # event at once and idled while the host worked, and its last kernel (40 us) ran past the host's end event:
    # the device measures 340 us, longer than the host. The model's compute is the 90 us the device did not idle.
    got = measure([(0.0, True), (340e-6, False)], bookkeeping=250e-6)
    assert got == pytest.approx(90e-6)


def test_a_device_behind_the_whole_interval_keeps_its_time_whole():
    # The device had not reached the start event when the host ended the interval: every kernel of it was
    # queued, and it ran them back to back (500 us) whatever the host did meanwhile.
    got = measure([(0.0, False), (500e-6, False)], bookkeeping=250e-6)
    assert got == pytest.approx(500e-6)


def test_the_rule_itself():
    assert interval_seconds(1.0, 0.25, caught_up=True) == 0.75
    assert interval_seconds(1.0, 0.25, caught_up=False) == 1.0
    assert interval_seconds(0.1, 0.25, caught_up=True) == 0.0  # never negative
