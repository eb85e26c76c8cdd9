"""Pricing at measured operator-class rates (Note [Operator classes] in swap/forecast/pricing.py): an operator of
each class at its class's rate, CPU flash attention at its head dim's rate, everything else and every GPU
profile on the roofline exactly as before. No timing."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from swap.capture import ALLOC, OP, TraceBuilder, capture
from swap.devices import PROFILES, DeviceProfile
from swap.forecast.pricing import (
    ATTENTION,
    FRESH_PAGES_MIN,
    OP_CLASSES,
    attention_head_dim,
    attention_rate,
    class_seconds,
    event_seconds,
    packet,
)

ROOFLINE = DeviceProfile("test", 1e12, 4e12, 100e9, 10e9, 10e9, 1 << 30, efficiency=1.0, op_overhead=1e-6)
# Distinct rates per class (FLOP/s, bytes/s), none of them the roofline's; convolutions pay both terms.
RATES = {cls: (1e12 if cls.startswith("conv") else 0.0, 1e9 * (k + 2)) for k, cls in enumerate(OP_CLASSES)}
ATTENTION_FLOPS = ((8, 10e9), (32, 40e9), (128, 100e9))
MEASURED = dataclasses.replace(ROOFLINE, class_rates=RATES, attention_flops=ATTENTION_FLOPS)


def one_op_each():
    """A trace with every class's operators (as captured names, with an overload) and a multiply, each with
    its own FLOPs and bytes; (trace, the operator events)."""
    b = TraceBuilder()
    names = [f"{name}.default" for ops in OP_CLASSES.values() for name in ops] + ["aten.mul.Tensor"]
    for k, name in enumerate(names):
        b.add_op(name, flops=1e6 * (k + 1), nbytes=3e6 * (k + 1), module=-1, phase=1, precision=0)
        b.add(ALLOC, k, size=FRESH_PAGES_MIN * (k % 2))  # every other operator returns fresh pages
    t = b.build({"format_version": 6})
    return t, np.flatnonzero(t.op == OP)


def test_each_class_is_priced_at_its_rate_and_the_rest_on_the_roofline():
    t, ops = one_op_each()
    seconds = event_seconds(t, MEASURED)
    roofline = event_seconds(t, ROOFLINE)
    for cls, names in OP_CLASSES.items():
        flop_rate, byte_rate = RATES[cls]
        for k in ops:
            if packet(t.op_name(k)) in names:
                expected = t.bytes[k] / byte_rate + (t.flops[k] / flop_rate if flop_rate else 0.0) + 1e-6
                assert seconds[k] == pytest.approx(expected), t.op_name(k)
                assert seconds[k] != pytest.approx(roofline[k])
    assert class_seconds(2e12, 3e9, (1e12, 1e9)) == pytest.approx(5.0)  # both terms, added
    assert class_seconds(2e12, 3e9, (0.0, 1e9)) == pytest.approx(3.0)  # 0: no such term
    mul = ops[-1]
    assert seconds[mul] == roofline[mul] == pytest.approx(3e6 * len(ops) / 100e9 + 1e-6)
    # A class the profile has no rate for stays on the roofline.
    partial = dataclasses.replace(MEASURED, class_rates={"tanh": RATES["tanh"]})
    tanh = [k for k in ops if t.op_name(k) == "aten.tanh.default"][0]
    priced = event_seconds(t, partial)
    assert priced[tanh] == seconds[tanh]
    assert np.array_equal(np.delete(priced, [k for k in ops if "tanh" in t.op_name(k)]),
                          np.delete(roofline, [k for k in ops if "tanh" in t.op_name(k)]))  # fmt: skip


def test_large_outputs_pay_their_fresh_pages_on_the_operator_that_returns_them():
    b = TraceBuilder()
    for size in (FRESH_PAGES_MIN, FRESH_PAGES_MIN - 4096, 0):
        b.add_op("aten.mul.Tensor", flops=0.0, nbytes=3e6, module=-1, phase=1, precision=0)
        if size:
            b.add(ALLOC, size, size=size)
    b.add(ALLOC, 99, size=2 * FRESH_PAGES_MIN)  # the output of the last operator
    t = b.build({"format_version": 6})
    fresh = dataclasses.replace(ROOFLINE, fresh_page_bandwidth=1e9)
    seconds, roofline = event_seconds(t, fresh), event_seconds(t, ROOFLINE)
    ops = np.flatnonzero(t.op == OP)
    assert seconds[ops[0]] == pytest.approx(roofline[ops[0]] + FRESH_PAGES_MIN / 1e9)
    assert seconds[ops[1]] == roofline[ops[1]]  # below glibc's threshold: heap memory, no fresh pages
    assert seconds[ops[2]] == pytest.approx(roofline[ops[2]] + 2 * FRESH_PAGES_MIN / 1e9)
    assert (seconds[t.op == ALLOC] == 0).all()


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_a_gpu_profile_prices_exactly_as_the_roofline(name):
    dev = PROFILES[name]
    assert dev.class_rates is None and dev.attention_flops == ()
    t, _ = one_op_each()
    expected = dev.step_seconds(t.flops, t.bytes, np.zeros(len(t), dtype=bool))
    assert np.array_equal(event_seconds(t, dev), expected)


class Attention(nn.Module):
    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.proj = nn.Linear(heads * head_dim, heads * head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q).sum()


@pytest.mark.parametrize(("heads", "head_dim"), [(4, 8), (2, 16), (1, 64), (2, 256)])
def test_cpu_flash_attention_is_priced_at_its_head_dims_rate(heads, head_dim):
    t = capture(lambda: Attention(heads, head_dim), lambda n: torch.randn(n, 32, heads * head_dim), 2,
                lambda m, x: m(x), target="cpu")  # fmt: skip
    attention = [k for k in np.flatnonzero(t.op == OP) if "flash_attention" in t.op_name(k)]
    assert [packet(t.op_name(k)) == ATTENTION for k in attention] == [True, False] * len(t.iterations())
    seconds, roofline = event_seconds(t, MEASURED), event_seconds(t, ROOFLINE)
    rate = attention_rate(head_dim, ATTENTION_FLOPS)
    for k in attention:
        assert attention_head_dim(t, k) == head_dim
        assert seconds[k] == pytest.approx(t.flops[k] / rate + 1e-6)
    others = np.ones(len(t), dtype=bool)
    others[attention] = False
    assert np.array_equal(seconds[others], roofline[others])  # the linear layer, the sum: roofline


def test_attention_rates_interpolate_in_log2_of_the_head_dim_and_clamp():
    assert attention_rate(8, ATTENTION_FLOPS) == 10e9 and attention_rate(32, ATTENTION_FLOPS) == 40e9
    assert attention_rate(16, ATTENTION_FLOPS) == pytest.approx(25e9)  # halfway between 8 and 32 in log2
    assert attention_rate(64, ATTENTION_FLOPS) == pytest.approx(70e9)
    assert attention_rate(4, ATTENTION_FLOPS) == 10e9 and attention_rate(512, ATTENTION_FLOPS) == 100e9


def test_attention_whose_outputs_do_not_give_the_head_dim_stays_on_the_roofline():
    b = TraceBuilder()
    b.add_op(f"{ATTENTION}.default", flops=1e9, nbytes=1e6, module=-1, phase=1, precision=0)  # no allocations
    t = b.build({"format_version": 6})
    assert attention_head_dim(t, 0) is None
    assert event_seconds(t, MEASURED)[0] == event_seconds(t, ROOFLINE)[0] == pytest.approx(1e-3 + 1e-6)
