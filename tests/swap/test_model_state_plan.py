"""Model state in the pure schedule: clean variables (weights streamed from their host master) in the
sequence, the scheduler and the simulator, and ``plan_model_state``'s placements under a device room."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from schedule_check import check_schedule

from swap import InfeasibleBudget, Sequence, make_schedule, simulate
from swap.schedule.model_state import (
    Bucket,
    ModelStateDoesNotFit,
    ParamInfo,
    Placement,
    UpdateSite,
    pack,
    pack_buckets,
    plan_bytes,
    plan_model_state,
)


def weights_and_activations(clean: bool = True) -> Sequence:
    """A two-layer net: weight w0 (v0) and w1 (v1) read in the forward and again in the backward, activations
    a0 (v2), a1 (v3) saved in the forward and used in the backward."""
    var = [0, 2, 1, 3, 3, 1, 2, 0]
    kind = ["use", "save", "use", "save", "use", "use", "use", "use"]
    return Sequence(var, kind, [100, 100, 50, 50], [10] * 8, [1.0] * 8, clean=[clean, clean, False, False])


def test_clean_defaults_to_false_and_an_old_profile_still_loads(tmp_path):
    seq = Sequence([0, 0], ["save", "use"], [8], [0, 0], [1.0, 1.0])
    assert seq.clean == [False]
    old = {k: v for k, v in json.loads(seq.save(tmp_path / "p.json").read_text()).items() if k != "clean"}
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded, _ = Sequence.load(tmp_path / "old.json")
    assert loaded.clean == [False]
    seq = weights_and_activations()
    seq.save(tmp_path / "w.json")
    assert Sequence.load(tmp_path / "w.json")[0].clean == [True, True, False, False]


def test_only_a_clean_variable_may_be_fetched_before_it_is_saved():
    weights_and_activations(clean=True)
    with pytest.raises(ValueError, match="used before it is saved.*clean"):
        weights_and_activations(clean=False)
    with pytest.raises(ValueError, match="clean must have one entry per variable"):
        Sequence([0], ["save"], [1], [0], [0.0], clean=[True, False])


@pytest.mark.parametrize("policy", ["window", "fixed_distance", "all", "none"])
def test_a_clean_variable_is_fetched_before_each_use_and_dropped_without_a_copy(policy):
    seq = weights_and_activations()
    s = make_schedule(seq, 10 + 200 if policy != "none" else 10_000, 150 if policy == "window" else None, policy)
    check_schedule(seq, s)
    fetched = [v for step in s.swap_in for v in step]
    assert {0, 1} <= set(fetched)  # from its host home, before (or at) its first use
    assert not {0, 1} & {v for step in s.swap_out for v in step}  # never copied out
    sim = simulate(seq, s, 1e3, 1e3)
    assert sim.d2h_bytes == sum(seq.sizes[v] for step in s.swap_out for v in step)
    assert sim.h2d_bytes == sum(seq.sizes[v] for v in fetched)


def test_a_clean_release_costs_no_d2h_even_if_a_schedule_names_its_swap_out():
    seq = weights_and_activations()
    s = make_schedule(seq, 210, 150, "window")
    s.swap_out[0].append(0)  # a hand-made schedule that asks for a copy of clean v0
    assert simulate(seq, s, 1e3, 1e3).d2h_bytes == sum(seq.sizes[v] for step in s.swap_out for v in step) - 100


def test_without_clean_variables_schedules_are_as_before():
    # the same accesses with the weights saved in the forward first: the weights are then copied out
    var = [0, 2, 1, 3, 3, 1, 2, 0]
    kind = ["save", "save", "save", "save", "use", "use", "use", "use"]
    dirty = Sequence(var, kind, [100, 100, 50, 50], [10] * 8, [1.0] * 8)
    s = make_schedule(dirty, 210, 150, "window")
    assert 0 in [v for step in s.swap_out for v in step]
    assert simulate(dirty, s, 1e3, 1e3).d2h_bytes >= 100


@st.composite
def clean_sequences(draw):
    n_vars = draw(st.integers(1, 8))
    sizes = [draw(st.integers(1, 100)) for _ in range(n_vars)]
    clean = [draw(st.booleans()) for _ in range(n_vars)]
    var = [draw(st.integers(0, n_vars - 1)) for _ in range(draw(st.integers(n_vars, 30)))]
    seen: set[int] = set()
    kind = []
    for v in var:
        kind.append("use" if clean[v] or v in seen else "save")
        seen.add(v)
    n = len(var)
    return Sequence(var, kind, sizes, [draw(st.integers(0, 100)) for _ in range(n)], [1.0] * n, clean=clean)


@settings(max_examples=200, deadline=None)
@given(seq=clean_sequences(), budget=st.integers(1, 600), window=st.integers(1, 600),
       policy=st.sampled_from(["window", "fixed_distance", "all"]))  # fmt: skip
def test_with_clean_variables_no_policy_plans_above_the_budget_or_copies_one_out(seq, budget, window, policy):
    try:
        s = make_schedule(seq, budget, min(window, budget), policy)
    except InfeasibleBudget as e:
        assert e.needed > budget
        return
    assert s.peak <= budget
    check_schedule(seq, s)
    assert not any(seq.clean[v] for step in s.swap_out for v in step)
    assert simulate(seq, s, 50.0, 50.0).d2h_bytes == sum(seq.sizes[v] for step in s.swap_out for v in step)


# -- plan_model_state ---------------------------------------------------------------------------------------
def llm_buckets(n=10, numel=1000):
    """bf16 weights and gradients, fp32 master and AdamW state: 2 + 2 + 4 + 8 bytes a parameter."""
    return [Bucket(i, (f"p{i}",), numel, 2 * numel, 4 * numel, 2 * numel, 8 * numel) for i in range(n)]


def test_pack_buckets_never_splits_a_parameter_and_keeps_the_order():
    params = [ParamInfo(f"p{i}", n, 2 * n, 4 * n, 2 * n, 8 * n) for i, n in enumerate([10, 10, 30, 2, 20, 5, 5, 5])]
    buckets = pack_buckets(params, bucket_bytes=40)
    assert [b.params for b in buckets] == [("p0", "p1"), ("p2",), ("p3",), ("p4",), ("p5", "p6", "p7")]
    # p2 alone is over the size: a bucket of its own; no bucket passes the size otherwise (Note [One packer])
    assert [b.weight_bytes for b in buckets] == [40, 60, 4, 40, 30]
    assert buckets[0].state_bytes == 160 and [b.index for b in buckets] == [0, 1, 2, 3, 4]
    # the runtime's storages pack alike: sizes in MiB [4, 40, 20, 20] at 32 MiB, each alone; an order given
    assert pack([4, 40, 20, 20], 32) == [[0], [1], [2], [3]] and pack([4, 20, 8], 32, order=[2, 0]) == [[2, 0, 1]]
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        pack_buckets(params, 0)


def test_resident_and_offload_modes():
    buckets = llm_buckets()
    res = plan_model_state(buckets, 10**9, placement="resident")
    assert set(res.placements) == {Placement.RESIDENT} and set(res.update_sites) == {UpdateSite.DEVICE}
    assert res.device_bytes == 10 * 1000 * 16 and res.host_bytes == 0
    off = plan_model_state(buckets, 10**9, placement="streamed")
    assert set(off.placements) == {Placement.STREAMED} and set(off.update_sites) == {UpdateSite.HOST}
    assert off.device_bytes == 2 * (2000 + 2000)  # two buckets' weights in flight, two gradients not yet out
    # host: master 4 + grad 2 + state 8 + the bf16 copy the H2D reads 2 = 16 bytes a parameter
    assert off.host_bytes == 10 * 1000 * 16 and off.pinned_bytes == 10 * 1000 * 4


def test_auto_fills_resident_first_in_forward_order_then_host_masters():
    buckets = llm_buckets()
    room = 8000 + 3 * 16000 + 2 * 2000  # the in-flight reserve, three resident, two compute copies
    plan = plan_model_state(buckets, room)
    R, H, S = Placement.RESIDENT, Placement.HOST_MASTER, Placement.STREAMED
    assert plan.placements == [R, R, R, H, H, S, S, S, S, S]
    assert plan.device_bytes == room
    capped = plan_model_state(buckets, room, resident_room=16000)
    # one resident; every other bucket keeps a compute copy, and with none streamed no weights are in flight
    assert capped.placements == [R] + [H] * 9 and capped.device_bytes == 16000 + 9 * 2000 + 2 * 2000


def test_auto_with_room_for_everything_is_all_resident_with_no_reserve():
    buckets = llm_buckets()
    plan = plan_model_state(buckets, 10 * 16000)
    assert set(plan.placements) == {Placement.RESIDENT} and plan.device_bytes == 160000


def test_refusals_name_what_would_fit():
    buckets = llm_buckets()
    with pytest.raises(ModelStateDoesNotFit, match="raise the budget by 1000 B") as e:
        plan_model_state(buckets, 7000)
    assert e.value.what == "device" and e.value.needed == 8000
    with pytest.raises(ModelStateDoesNotFit, match="use placement='auto' or 'streamed'"):
        plan_model_state(buckets, 10**5, placement="resident")
    with pytest.raises(ModelStateDoesNotFit, match="smallest host that fits is") as e:
        plan_model_state(buckets, 8000, host_memory=10**5)
    assert e.value.what == "host" and e.value.needed == 160000
    with pytest.raises(ValueError, match="unknown placement .everything.: choose one of"):
        plan_model_state(buckets, 8000, placement="everything")


def test_speculation_stages_slots_on_the_host():
    buckets = llm_buckets()
    plain = plan_model_state(buckets, 8000, placement="streamed")
    spec = plan_model_state(buckets, 8000, placement="streamed", speculate=True, staging_slots=3)
    assert spec.speculate and spec.staging_slots == 3
    assert spec.host_bytes - plain.host_bytes == 3 * 12000  # (master, state) per slot
    # Note [Rollback copies]: pageable (no copy engine reads them), also where the master is what the link reads
    fp32 = [Bucket(i, (f"p{i}",), 1000, 4000, 4000, 4000, 8000) for i in range(4)]
    copies = plan_model_state(fp32, 10**5, placement="streamed", speculate=True, staging_slots=4)
    alone = plan_model_state(fp32, 10**5, placement="streamed")
    assert copies.host_bytes - alone.host_bytes == 4 * 12000 and copies.pinned_bytes == alone.pinned_bytes
    assert not plan_model_state(buckets, 10**6, speculate=True).speculate  # all resident: nothing to speculate


@settings(max_examples=200, deadline=None)
@given(numels=st.lists(st.integers(1, 5000), min_size=1, max_size=30), room=st.integers(0, 300_000),
       share=st.floats(0, 1), fp32=st.booleans())  # fmt: skip
def test_auto_never_plans_above_the_room(numels, room, share, fp32):
    w = 4 if fp32 else 2
    buckets = [Bucket(i, (f"p{i}",), n, w * n, 4 * n, w * n, 8 * n) for i, n in enumerate(numels)]
    try:
        plan = plan_model_state(buckets, room, resident_room=int(share * room))
    except ModelStateDoesNotFit as e:
        assert e.needed > room == e.available
        assert plan_bytes(buckets, [Placement.STREAMED] * len(buckets))[0] > room
        return
    assert plan.device_bytes == plan_bytes(buckets, plan.placements)[0] <= room
    # a resident prefix, then host masters, then streamed: nothing else
    order = [list(Placement).index(p) for p in plan.placements]
    assert order == sorted(order)
