"""The scheduler's memory model of a captured trace agrees with the trace the runtime would make."""

import pytest

from bench.traces import capture
from swap.capture import ALLOC, FREE, live_peak
from swap.forecast.from_trace import plan_for, swapped


@pytest.mark.parametrize("model,batch,size", [("resnet50", 4, 64), ("unet", 2, 64), ("gpt2", 1, 64)])
def test_planned_peak_is_the_swapped_traces_peak(model, batch, size):
    # Note [Held after the last use]: a variable's last use hands it to autograd, which frees it only when the
    # node that read it returns. Counting it until then makes the plan's peak the swapped trace's peak.
    t = capture(model, batch, steps=2, size=size, progress=False)
    seq, _ = plan_for(t, 1 << 40, "none")
    floor = seq.step_floor()
    budget = (floor + seq.no_swap_peak()) // 2
    _, sched = plan_for(t, budget, "window", window=budget // 4)
    st = swapped(t, budget, schedule=sched)
    begin, end = st.iterations()[-1]
    live = peak = 0
    for k, (o, s) in enumerate(zip(st.op.tolist(), st.size.tolist())):
        live += s if o == ALLOC else -s if o == FREE else 0
        if k >= begin:
            peak = max(peak, live)
    assert peak <= sched.peak <= budget  # the plan never under-counts (it did by a whole tensor)
    assert sched.peak - peak <= peak // 1000
    assert live_peak(st) <= budget <= seq.no_swap_peak()
