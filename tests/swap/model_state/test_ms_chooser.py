"""The runtime chooses model-state placements with the forecast's chooser (issue 37 item 1): ``decide`` takes
the buckets out of the profiled iteration (``without_weights``, the inverse of ``with_weights``), prices them by
what the manager measured (``measured_prices``; named defaults where nothing was measured yet) and applies what
``choose_model_state`` keeps (Note [Placing model state under the budget] in swap/runtime/model_state/wiring.py)."""

from dataclasses import replace

import pytest
import torch
from torch import nn

import swap
from swap import Sequence
from swap.runtime.model_state import wiring
from swap.runtime.model_state.wiring import DEFAULT_HOST_STEP_RATE, DEFAULT_LINK_BANDWIDTH, measured_prices
from swap.schedule.model_state import Bucket, ModelStatePlan, Placement, choose_model_state, plan_model_state
from swap.schedule.model_state.choice import rooms_of
from swap.schedule.model_state.weights import BucketUses, model_state_bytes, with_weights, without_weights

R, H, S = Placement.RESIDENT, Placement.HOST_MASTER, Placement.STREAMED


def test_without_weights_undoes_with_weights():
    """Four layers whose buckets are read at forward step k and backward step 7 - k, streamed, inserted as clean
    uses, then taken out: the activations and the uses come back as they were, ``nonswap`` with the gradients
    the streamed plan held (a profile holds them too: Note [Weights out of a profile])."""
    n = 4
    var = list(range(n)) + list(reversed(range(n)))
    seq = Sequence(var, ["save"] * n + ["use"] * n, [100] * n, [10 + i for i in range(2 * n)],
                   [1.0 + i for i in range(2 * n)], node_last=[0, 1, 2, 3, 5, 5, 6, 7])  # fmt: skip
    buckets = [Bucket(k, (f"l{k}.w",), 50, 200, 200, 200, 400) for k in range(n)]
    uses = [BucketUses((k,), (2 * n - 1 - k,)) for k in range(n)]
    plan = ModelStatePlan.uniform(n, S)
    w = with_weights(seq, buckets, uses, plan)
    assert len(w.seq) == 2 * n + 2 * n and sum(w.seq.clean) == n
    acts, got = without_weights(w.seq)
    assert got == uses
    assert (acts.var, acts.kind, acts.sizes, acts.node_last) == (seq.var, seq.kind, seq.sizes, seq.node_last)
    assert acts.compute == seq.compute and not any(acts.clean)
    grads = model_state_bytes(len(seq), buckets, uses, plan)
    assert acts.nonswap == [a + g for a, g in zip(seq.nonswap, grads)] and grads[n] > 0 == grads[0]


def test_a_runtime_profile_reads_its_first_and_last_layers_uses_right():
    """As the runtime records it: a bucket's forward use before its module saves (the first before any step), its
    backward use between the forward's last save and the first unpack, or after it."""
    # vars 0, 1: buckets (clean); 2, 3: activations. use b0, save a2, use b1, save a3 | use b1, use a3, use b0, use a2
    seq = Sequence([0, 2, 1, 3, 1, 3, 0, 2], ["use", "save", "use", "save", "use", "use", "use", "use"],
                   [64, 64, 100, 100], [0] * 8, [1.0] * 8, clean=[True, True, False, False])  # fmt: skip
    acts, uses = without_weights(seq)
    assert acts.var == [0, 1, 1, 0] and acts.compute == [3.0, 2.0, 2.0, 1.0]
    assert uses == [BucketUses((0,), (2,)), BucketUses((0,), (1,))]


def test_prices_not_measured_yet_take_the_named_defaults():
    buckets = [Bucket(k, (f"l{k}.w",), 50, 200, 200, 200, 400) for k in range(3)]
    m = measured_prices(buckets, None, {})
    assert m.measured == [] and set(m.defaults) == {"h2d_bandwidth", "d2h_bandwidth", "host_step_seconds_per_byte"}
    assert m.prices.h2d_bandwidth == m.prices.d2h_bandwidth == DEFAULT_LINK_BANDWIDTH
    assert m.prices.host_step_seconds == pytest.approx((800 / DEFAULT_HOST_STEP_RATE,) * 3)
    # the first host step makes the optimizer state: the later ones are the rate, per byte of what was stepped
    m = measured_prices(buckets, None, {1: 9.0, 2: 2.4, 3: 3.0})
    assert m.measured == ["host_step_seconds_per_byte"] and m.prices.host_step_seconds == pytest.approx((0.8,) * 3)


def stack(d: int = 128) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d), nn.GELU(), nn.Linear(d, 2 * d), nn.GELU(),
                         nn.Linear(2 * d, d), nn.LayerNorm(d), nn.Linear(d, d))  # fmt: skip


DEVICE_STEP = 0.5  # seconds a resident bucket's device step takes, injected: resident buckets become the slowest


def test_the_runtime_applies_what_choose_model_state_keeps(monkeypatch):
    """With the measured prices and a device step injected that makes resident buckets slow, the plan the runtime
    applies is ``choose_model_state``'s on the profiled activations, and not the one greedy by bytes (resident
    first: all 8 buckets here) that the runtime applied before it called the chooser."""
    seen = {}
    original_prices, original_choose = wiring.measured_prices, wiring.choose

    def prices(buckets, engine, host_seconds):
        m = original_prices(buckets, engine, host_seconds)
        m.prices = replace(m.prices, device_step_seconds=(DEVICE_STEP,) * len(buckets))
        seen["measured"] = m
        return m

    def choose(seq, buckets, room, budget, measured, placement="auto", accumulation=0, speculative=False):
        seen.update(seq=seq, buckets=buckets, room=room, budget=budget, accumulation=accumulation,
                    speculative=speculative)  # fmt: skip
        return original_choose(seq, buckets, room, budget, measured, placement, accumulation, speculative)

    monkeypatch.setattr(wiring, "measured_prices", prices)
    monkeypatch.setattr(wiring, "choose", choose)
    model = stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 128), torch.randint(0, 128, (8,))
    with swap.SwapManager(budget="1GiB", device="cpu", policy="window", min_bytes=0, model=model, optimizer=opt,
                          model_state=swap.ModelStatePolicy(bucket_bytes="64KiB")) as sm:  # fmt: skip
        for _ in range(4):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    applied = sm.model_state.plan
    assert applied is not None and "seq" in seen
    buckets, m = seen["buckets"], seen["measured"]
    acts, uses = without_weights(seen["seq"], buckets)
    # the first layer's weight is not read by its backward (its input needs no gradient): its gradient is made where
    # its input is unpacked
    assert len(buckets) == 8 and len(uses) == 8 and all(u.forward and u.backward for u in uses)
    rooms = rooms_of(seen["room"], whole=True)
    assert seen["speculative"] == sm.model_state.speculate
    expected = choose_model_state(acts, buckets, uses, seen["budget"], m.prices, rooms=rooms,
                                  accumulation=seen["accumulation"], speculative=seen["speculative"])  # fmt: skip
    assert applied.placements == expected.plan.placements
    greedy = plan_model_state(buckets, seen["room"], accumulation=seen["accumulation"])
    assert greedy.placements == [R] * 8  # what the runtime applied before
    assert applied.placements != greedy.placements and R not in applied.placements
    # the report: which plan, its simulated step, the prices and which of them were measured
    choice = sm.report()["model_state"]["choice"]
    assert choice["chooser"] == "choose_model_state"
    assert choice["simulated_step_seconds"] == expected.sim.step_time > 0
    assert choice["plan_room"] == expected.room and choice["resident_share"] == expected.resident
    assert choice["placements"] == {p.value: n for p in Placement if (n := applied.placements.count(p))}
    assert set(choice["measured"]) == {"h2d_bandwidth", "d2h_bandwidth", "host_step_seconds_per_byte"}
    assert choice["prices"]["h2d_bandwidth"] == m.prices.h2d_bandwidth > 0


def test_a_profile_without_activations_still_places_its_buckets():
    """Every saved tensor under ``min_bytes``: the profile is the buckets' uses alone (forward 0 1 2, backward
    2 1 0, the last bucket read once across the turn). Its stand-in steps keep their order; the chooser places
    them (all resident: nothing is priced for a device step) where the window search once looped for ever on a
    sequence of empty variables."""
    seq = Sequence([0, 1, 2, 1, 0], ["use"] * 5, [400, 400, 400], [0] * 5, [1.0] * 5, clean=[True] * 3)
    buckets = [Bucket(k, (f"l{k}.w",), 100, 400, 400, 400, 800) for k in range(3)]
    acts, uses = without_weights(seq, buckets)
    assert len(acts) == 5 and acts.sizes == [0] and acts.compute == [1.0] * 5
    assert uses == [BucketUses((0,), (4,)), BucketUses((1,), (3,)), BucketUses((2,), (3,))]
    choice = choose_model_state(acts, buckets, uses, 1 << 20, measured_prices(buckets, None, {}).prices)
    assert choice.plan.placements == [R] * 3 and choice.sim.step_time == pytest.approx(5.0)
