"""Weights in the sequence (``with_weights``) and the model-state simulator (host-step lane, gradients out
during the backward, update-before-use, speculation, casts, the link's duplex limit, DRAM contention), on
hand-built layers whose right answers are known."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from schedule_check import check_schedule

from swap import InfeasibleBudget, Sequence, make_schedule
from swap.schedule.model_state import Bucket, ModelStatePlan, Placement, UpdateSite, plan_model_state
from swap.schedule.model_state.sim import Lane, ModelStatePrices, simulate_model_state
from swap.schedule.model_state.weights import BucketUses, model_state_bytes, with_weights
from swap.schedule.simulator import choose_window

R, H, S = Placement.RESIDENT, Placement.HOST_MASTER, Placement.STREAMED


def layers(n=4, act=100, compute=1.0):
    """n layers: the forward saves a0..a(n-1), the backward uses them in reverse; bucket k (layer k's weights,
    numel 50: bf16 100 B, fp32 master 200, bf16 grad 100, AdamW state 400) is read at forward step k and
    backward step 2n-1-k."""
    var = list(range(n)) + list(reversed(range(n)))
    seq = Sequence(var, ["save"] * n + ["use"] * n, [act] * n, [10] * (2 * n), [compute] * (2 * n))
    buckets = [Bucket(k, (f"l{k}.w",), 50, 100, 200, 100, 400) for k in range(n)]
    uses = [BucketUses((k,), (2 * n - 1 - k,)) for k in range(n)]
    return seq, buckets, uses


def prices(n=4, host=0.5, bandwidth=1000.0, **kw):
    return ModelStatePrices(bandwidth, bandwidth, (host,) * n, (0.05,) * n, **kw)


def run(seq, buckets, uses, plan, p, timing="before_use", budget=10_000):
    w = with_weights(seq, buckets, uses, plan)
    _win, sched, _ = choose_window(w.seq, budget, p.h2d_bandwidth, p.d2h_bandwidth)
    check_schedule(w.seq, sched)
    return w, sched, simulate_model_state(w, sched, buckets, uses, plan, p, timing=timing)


def test_streamed_buckets_become_clean_uses_that_take_the_steps_compute():
    seq, buckets, uses = layers()
    plan = ModelStatePlan.uniform(4, S)
    w = with_weights(seq, buckets, uses, plan)
    assert len(w.seq) == 16 and w.var_of == {0: 4, 1: 5, 2: 6, 3: 7}
    assert w.seq.var[:4] == [0, 4, 1, 5] and w.seq.kind[:4] == ["save", "use", "save", "use"]
    assert w.seq.compute[:4] == [0.0, 1.0, 0.0, 1.0]  # the bucket's step runs the layer's compute
    assert w.seq.clean == [False] * 4 + [True] * 4 and w.seq.sizes[4:] == [100] * 4
    assert w.holds == [1, 3, 5, 7, 9, 11, 13, 15]
    assert w.seq.node_last[0] == 1  # the activation's node runs during the bucket's step
    assert sum(w.seq.compute) == sum(seq.compute)


def test_resident_and_host_master_bytes_join_nonswap():
    seq, buckets, uses = layers()
    plan = ModelStatePlan([R, H, S, S], [UpdateSite.DEVICE] + [UpdateSite.HOST] * 3)
    ms = model_state_bytes(8, buckets, uses, plan, in_flight=2)
    # resident: weights 100 + master 200 + state 400 always, its gradient 100 from its backward step (7);
    # host master: its compute copy 100; offloaded gradients: while made, then 2 x 100 outstanding from step 5
    assert ms[0] == 700 + 100
    assert ms[4] == 800 + 100  # bucket 3's gradient is being made at step 4
    assert ms[5] == 800 + 100 + 200  # bucket 2's, and two outstanding
    assert ms[7] == 800 + 200 + 100  # two outstanding, and the resident gradient
    w = with_weights(seq, buckets, uses, plan)
    assert w.var_of == {2: 8 - 4, 3: 8 - 3}  # only the streamed buckets are variables
    assert w.seq.nonswap[0] == 10 + 800


def test_steps_merged_by_a_recompute_plan_keep_their_own_groups():
    seq, buckets, uses = layers(2)
    # the activation plan merged the two forward steps into one (a checkpointed block): holds maps them
    merged = Sequence([0, 0, 0], ["save", "use", "use"], [100], [10, 10, 10], [3.0, 1.0, 1.0])
    w = with_weights(merged, buckets, uses, ModelStatePlan.uniform(2, S), holds=[0, 0, 1, 2],
                     compute=[1.0, 2.0, 1.0, 1.0])  # fmt: skip
    # step 0 runs originals 0 and 1: bucket 0 in the first third of its compute, bucket 1 in the rest
    assert w.seq.var[:3] == [0, 1, 2] and w.seq.compute[:3] == [0.0, 1.0, 2.0]
    assert w.seq.node_last[1] == 1 and w.seq.node_last[2] == 2  # each group held through its own part
    assert w.holds == [1, 2, 4, 6]


def test_bad_arguments():
    seq, buckets, uses = layers()
    with pytest.raises(ValueError, match="one of each per bucket"):
        with_weights(seq, buckets[:2], uses, ModelStatePlan.uniform(4, S))
    with pytest.raises(ValueError, match="outside the 8 steps"):
        with_weights(seq, buckets, [BucketUses((9,), ())] * 4, ModelStatePlan.uniform(4, S))
    w = with_weights(seq, buckets, uses, ModelStatePlan.uniform(4, S))
    sched = make_schedule(w.seq, 10_000, 1000, "window")
    with pytest.raises(ValueError, match="unknown timing"):
        simulate_model_state(w, sched, buckets, uses, ModelStatePlan.uniform(4, S), prices(), timing="lazy")


def test_all_resident_steps_on_the_device_and_moves_no_weights():
    seq, buckets, uses = layers()
    _w, _s, sim = run(seq, buckets, uses, ModelStatePlan.uniform(4, R), prices())
    assert sim.host_seconds == 0 and set(sim.bytes_by_kind) <= {"activations"}
    assert sim.step_time == pytest.approx(8.0 + 4 * 0.05)  # the steps, then the device step
    assert sim.bound == "compute"


def test_host_steps_after_the_backward_block_and_before_use_hides_them_behind_the_forward():
    seq, buckets, uses = layers()
    plan = ModelStatePlan.uniform(4, S)
    _w, _s, blocking = run(seq, buckets, uses, plan, prices(), timing="blocking")
    _w, _s, before = run(seq, buckets, uses, plan, prices(), timing="before_use")
    # blocking: the last gradient out (0.1 s), 4 host steps of 0.5 s after the backward, every one exposed,
    # then the first fetch (0.1 s)
    assert blocking.step_time == pytest.approx(8.0 + 0.1 + 2.0 + 0.1, abs=0.01) and blocking.stalls["host"] > 1.9
    # before use: bucket k's fetch waits for its host step only; the forward hides the rest
    assert before.step_time < blocking.step_time - 1.0
    assert before.host_exposed < blocking.host_exposed
    assert before.bytes_by_kind["gradients"] == (0, 400) and before.bytes_by_kind["weights"][0] >= 400


def test_speculation_starts_staged_host_steps_in_the_backward():
    seq, buckets, uses = layers()
    plan = plan_model_state(buckets, 10**6, placement="streamed", speculate=True, staging_slots=2)
    assert plan.speculated() == [3, 2]  # the first offloaded buckets the backward finishes
    slow = prices(host=1.5)
    _w, _s, before = run(seq, buckets, uses, plan, slow, timing="before_use")
    _w, _s, spec = run(seq, buckets, uses, plan, slow, timing="speculative")
    assert spec.speculated == 2 and before.speculated == 0
    assert spec.step_time < before.step_time
    # a speculative step first copies its master and state for a rollback (Note [Rollback copies]): priced on the
    # host lane of the staged buckets only
    copying = prices(host=1.5, save_seconds=(0.25,) * 4)
    _w, _s, saved = run(seq, buckets, uses, plan, copying, timing="speculative")
    _w, _s, unsaved = run(seq, buckets, uses, plan, copying, timing="before_use")
    assert saved.host_seconds == pytest.approx(spec.host_seconds + 2 * 0.25)
    assert unsaved.host_seconds == pytest.approx(before.host_seconds) and saved.step_time >= spec.step_time


def test_host_masters_wait_for_their_update_copy():
    seq, buckets, uses = layers()
    plan = ModelStatePlan.uniform(4, H)
    _w, _s, sim = run(seq, buckets, uses, plan, prices(host=2.0))
    assert sim.bytes_by_kind["weights"] == (400, 0)  # one update copy each, no fetches
    assert sim.stalls.get("update", 0) > 0 and sim.host_exposed == pytest.approx(sim.stalls["update"])


def test_the_host_lane_binds_when_it_is_the_slowest():
    seq, buckets, uses = layers()
    _w, _s, sim = run(seq, buckets, uses, ModelStatePlan.uniform(4, S), prices(host=5.0))
    assert sim.bound == "host" and sim.lower_bound == pytest.approx(20.0) and sim.step_time >= 20.0


def test_duplex_limit_and_dram_contention_only_slow_things_down():
    seq, buckets, uses = layers(act=400)
    plan = ModelStatePlan.uniform(4, S)
    budget = 10 + 3 * 400
    free = run(seq, buckets, uses, plan, prices(), budget=budget)[2]
    duplex = run(seq, buckets, uses, plan, prices(duplex_bandwidth=100.0), budget=budget)[2]
    dram = run(seq, buckets, uses, plan, prices(dram_bandwidth=10.0, host_step_bytes=(5.0,) * 4), budget=budget)[2]
    assert duplex.step_time >= free.step_time and dram.step_time >= free.step_time
    assert "link" in {duplex.bound} or duplex.lower_bound >= free.lower_bound


def test_device_casts_are_charged_at_each_fetch():
    seq, buckets, uses = layers()
    plan = ModelStatePlan.uniform(4, S)
    plain = run(seq, buckets, uses, plan, prices())[2]
    cast = run(seq, buckets, uses, plan, prices(cast_seconds=(0.1,) * 4))[2]
    fetches = cast.bytes_by_kind["weights"][0] // 100
    assert cast.compute_time == pytest.approx(plain.compute_time + 0.1 * fetches)


def test_mixed_precision_casts_once_an_iteration():
    # Note [One cast per master change]: the runtime casts a master at its first fetch after the host step only
    seq, buckets, uses = layers()
    plan = ModelStatePlan.uniform(4, S)
    budget = 500  # tight: some buckets are fetched for the forward and again for the backward
    plain = run(seq, buckets, uses, plan, prices(), budget=budget)[2]
    each = run(seq, buckets, uses, plan, prices(cast_seconds=(0.1,) * 4), budget=budget)[2]
    once = run(seq, buckets, uses, plan, prices(cast_seconds=(0.1,) * 4, cast_once=True), budget=budget)[2]
    fetches = each.bytes_by_kind["weights"][0] // 100
    assert fetches > 4  # fetched more than once a bucket: the test can tell once from each
    assert each.compute_time == pytest.approx(plain.compute_time + 0.1 * fetches)
    assert once.compute_time == pytest.approx(plain.compute_time + 0.1 * 4)


def test_lane_takes_the_earliest_gap():
    lane = Lane()
    assert lane.place(0.0, 1.0) == (0.0, 1.0)
    assert lane.place(5.0, 1.0) == (5.0, 6.0)
    assert lane.place(0.5, 2.0) == (1.0, 3.0)  # fits between, after the first
    assert lane.place(2.0, 3.0) == (6.0, 9.0)  # the gap 3..5 is too short
    assert lane.busy(0.0, 10.0) == pytest.approx(7.0)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), room=st.integers(0, 6000), share=st.floats(0, 1), budget=st.integers(200, 4000))
def test_the_weighted_schedule_never_plans_above_the_budget(n, room, share, budget):
    seq, buckets, uses = layers(n)
    try:
        plan = plan_model_state(buckets, room, resident_room=int(share * room))
    except ValueError:
        return
    w = with_weights(seq, buckets, uses, plan)
    try:
        s = make_schedule(w.seq, budget, min(budget, 300), "window")
    except InfeasibleBudget:
        return
    assert s.peak <= budget
    check_schedule(w.seq, s)
    sim = simulate_model_state(w, s, buckets, uses, plan, prices(n))
    assert sim.step_time >= sim.lower_bound - 1e-9


def test_choose_model_state_keeps_the_fastest_plan_that_fits():
    from swap.schedule.model_state import ModelStateDoesNotFit
    from swap.schedule.model_state.choice import choose_model_state

    seq, buckets, uses = layers()
    slow_host = prices(host=3.0)
    roomy = choose_model_state(seq, buckets, uses, 10_000, slow_host, speculative=False)
    assert set(roomy.plan.placements) == {R}  # room for everything: nothing leaves the device, no host steps
    assert roomy.sim.host_seconds == 0 and roomy.placed.schedule.peak <= 10_000
    # speculating (the runtime's default), the bucket the backward finishes first steps on the host during the
    # backward, hidden, and saves its device step
    hidden = choose_model_state(seq, buckets, uses, 10_000, slow_host)
    assert hidden.timing == "speculative" and hidden.plan.placements == [R, R, R, H]
    assert hidden.sim.host_exposed == 0 and hidden.sim.step_time < roomy.sim.step_time
    tight = choose_model_state(seq, buckets, uses, 1010, slow_host)
    offload = choose_model_state(seq, buckets, uses, 1010, slow_host, placement="streamed")
    assert tight.placed.schedule.peak <= 1010 and tight.sim.step_time <= offload.sim.step_time  # never slower
    # a short forward cannot hide every host step after opt.step(), a long backward can hide most of them
    seq.compute[:4] = [0.2] * 4
    # Note [Speculation as the runtime decides it]: speculative where the rollback copies of every bucket (master
    # 200 + state 400 each) fit beside the model state (800 a bucket streamed), as the runtime decides
    plain = choose_model_state(seq, buckets, uses, 1010, prices(host=0.8), placement="streamed", speculative=False)
    tight_host = choose_model_state(seq, buckets, uses, 1010, prices(host=0.8), placement="streamed",
                                    host_memory=4 * 800 + 4 * 600 - 1)  # fmt: skip
    assert tight_host.timing == "before_use" and not tight_host.plan.speculate
    assert tight_host.sim.step_time == plain.sim.step_time
    spec = choose_model_state(seq, buckets, uses, 1010, prices(host=0.8), placement="streamed", host_memory=10**6)
    assert spec.timing == "speculative" and spec.plan.speculated() == [3, 2, 1, 0]
    assert spec.plan.host_bytes == plain.plan.host_bytes + 4 * 600 and spec.sim.step_time < plain.sim.step_time
    with pytest.raises(ModelStateDoesNotFit, match="host"):
        choose_model_state(seq, buckets, uses, 1010, slow_host, placement="streamed", host_memory=100)
