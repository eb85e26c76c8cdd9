"""The FSDP2 side of model state under the budget (Note [Model state under FSDP2]): units offloaded by a byte budget
with FSDP2's own offload, clipping across ranks with one process group, the update gates ahead of FSDP2's
all-gather, and checkpoints that stay plain FSDP2 (DCP) with offload on either side. Two gloo ranks on CPU."""

import collections
import functools
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy

import swap
from bench.ranks import spawn
from swap.forecast import zoo
from swap.runtime.model_state import fsdp2
from swap.schedule.model_state import Placement
from swap.schedule.model_state.units import blocks_of, choose_offloaded

VOCAB, SEQ = 64, 16


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return zoo.gpt(n_layer=3, n_head=4, d_model=32, vocab=VOCAB, seq_len=SEQ)


def _sharded(offload: bool, counts=None, world: int = 2):
    model = _model()
    sizes = fsdp2.unit_bytes(model, fsdp2.default_units(model), world)
    # Room for the root and the first block: the last two blocks go to the host.
    plan = fsdp2.offload_by_budget(model, sizes[""] + sizes["blocks.0"] if offload else 1 << 40, world)
    fsdp2.shard(model, plan, pin_memory=False)
    if counts is not None:
        from fsdp_ranks import CountingAllGather  # the tests' counting all-gather

        for i, block in enumerate(model.blocks):
            block.set_custom_all_gather(CountingAllGather(f"blocks.{i}", counts))
    return model, plan


def _step(model, opt, rank: int, it: int, clip) -> tuple[float, float]:
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(10 * rank + it))
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    norm = clip(model.parameters(), 0.5)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    opt.step()
    return loss.item(), norm.item()


def _train(offload: bool, clip, rank: int, iterations: int = 3, counts=None, gate=None, host_steps: bool = False,
           manager=None):  # fmt: skip
    model, plan = _sharded(offload, counts)
    if gate is not None:
        fsdp2.gate_updates(model, plan, gate)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # every step runs another learning rate
    steps, queued = [], []
    host = fsdp2.HostSteps(model, plan, opt) if host_steps else None
    if manager is not None:
        manager.__enter__()
    for it in range(iterations):
        if counts is not None:
            counts.clear()
        steps.append(_step(model, opt, rank, it, clip))
        if host is not None:  # opt.step() returned with the offloaded units' host steps queued, not waited for
            queued.append(sorted(host.stepper.pending))
        sched.step()
    if manager is not None:
        manager.__exit__(None, None, None)
    return model, opt, plan, steps, host, queued


def _shards(model) -> list:
    return [p.to_local().clone() for p in model.parameters()]


def _plain_state(opt) -> list:
    """The optimizer's state dict as plain values (DTensors as their local shards), in a comparable form."""
    sd = opt.state_dict()
    local = lambda v: v.to_local() if hasattr(v, "to_local") else v  # noqa: E731
    return [sorted((k, local(v)) for k, v in st.items()) for _, st in sorted(sd["state"].items())]


def _same_state(a, b) -> bool:
    return len(a) == len(b) and all(
        [k for k, _ in x] == [k for k, _ in y] and all(torch.equal(u, v) for (_, u), (_, v) in zip(x, y))
        for x, y in zip(a, b)
    )


def _worker(rank: int, tmp: str) -> dict:
    plain, plain_opt, _, plain_steps, _, _ = _train(False, torch.nn.utils.clip_grad_norm_, rank)
    counts: collections.Counter = collections.Counter()
    seen = []
    gate = lambda path: seen.append((path, counts[path]))  # noqa: E731 - its all-gathers so far this iteration
    model, opt, plan, steps, host, queued = _train(True, fsdp2.clip_grad_norm_, rank, counts=counts, gate=gate,
                                                   host_steps=True)  # fmt: skip
    policies = {i: type(b._get_fsdp_state()._fsdp_param_group.offload_policy) for i, b in enumerate(model.blocks)}
    state_same = _same_state(_plain_state(plain_opt), _plain_state(opt))  # waits for the last host steps
    # With a SwapManager swapping every saved activation too: the same training.
    sm = swap.SwapManager(budget="64GiB", device="cpu", min_bytes=0, policy="all")
    swapped, swapped_opt, _, swapped_steps, swapped_host, _ = _train(True, fsdp2.clip_grad_norm_, rank,
                                                                     host_steps=True, manager=sm)  # fmt: skip
    swapped_host.close()
    with_manager = swapped_steps == plain_steps and _same_state(_plain_state(plain_opt), _plain_state(swapped_opt)) \
        and all(torch.equal(a, b) for a, b in zip(_shards(plain), _shards(swapped)))  # fmt: skip
    swapped_out = sm.report()["swapped_out_bytes"]
    same = all(torch.equal(a, b) for a, b in zip(_shards(plain), _shards(model)))
    report = host.report()
    # A checkpoint saved with offload loads into FSDP2 without it, and training goes on alike.
    ckpt = str(Path(tmp, "ckpt"))
    m_sd, o_sd = get_state_dict(model, opt)
    dcp.save({"model": m_sd, "optim": o_sd}, checkpoint_id=ckpt)
    fresh, _ = _sharded(False)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    _step(fresh, fresh_opt, rank, 99, torch.nn.utils.clip_grad_norm_)  # optimizer state to load into
    f_sd, fo_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": f_sd, "optim": fo_sd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = all(torch.equal(a, b) for a, b in zip(_shards(model), _shards(fresh)))
    after = (_step(model, opt, rank, 3, fsdp2.clip_grad_norm_), _step(fresh, fresh_opt, rank, 3,
                                                                      torch.nn.utils.clip_grad_norm_))  # fmt: skip
    host.close()
    after_same = _same_state(_plain_state(opt), _plain_state(fresh_opt)) and all(
        torch.equal(a, b) for a, b in zip(_shards(model), _shards(fresh)))  # fmt: skip
    return {"plain_steps": plain_steps, "steps": steps, "same": same, "offloaded": plan.offloaded,
            "policies": policies, "seen": seen, "loaded": loaded, "after": after, "state_same": state_same,
            "queued": queued, "report": report, "after_same": after_same, "with_manager": with_manager,
            "swapped_out": swapped_out}


@pytest.mark.slow
def test_offloaded_units_step_on_the_host_bitwise_clip_with_one_group_gate_the_gather_checkpoint_plainly(tmp_path):
    for rank, r in enumerate(spawn(_worker, tmp_path)):
        assert r["offloaded"] == ["blocks.1", "blocks.2"]
        assert r["policies"] == {0: type(fsdp2_offload_policy(False)), 1: CPUOffloadPolicy, 2: CPUOffloadPolicy}
        assert r["steps"] == r["plain_steps"], rank  # losses and total norms, clipping with our all-reduce
        assert r["plain_steps"][0][1] > 0.5  # the norm is over the bound: the clip scaled the gradients
        assert r["same"], rank  # parameters after three AdamW steps
        # Each offloaded unit's gate ran before FSDP2 first all-gathered that unit in each iteration (and again
        # before every later unshard: Note [Every unshard gated]).
        assert first_gates(r["seen"])[:6] == [("blocks.1", 0), ("blocks.2", 0)] * 3  # (then the step after the save)
        assert r["loaded"] and r["after"][0] == r["after"][1] and r["after_same"], rank
        # The offloaded units' update ran on the host worker after opt.step() returned, each waited for by its
        # unit's gate; the optimizer state (host steps' included) is plain FSDP2's, bitwise.
        assert r["queued"] == [[0, 1]] * 3
        assert sorted(r["report"]["host_step_seconds"]) == [1, 2, 3]
        assert r["state_same"], rank
        assert r["with_manager"] and r["swapped_out"] > 0, rank


def first_gates(seen: list) -> list:
    """The gate calls that came before any all-gather of their unit in the iteration (counts restart each one)."""
    return [s for s in seen if s[1] == 0]


def _prefetch_worker(rank: int, tmp: str) -> dict:
    """Offloaded units with explicit forward prefetch: each unit's all-gather is issued from the unit before's
    pre-forward, and the update gate must still come first."""
    plain, _, _, plain_steps, _, _ = _train(False, torch.nn.utils.clip_grad_norm_, rank, iterations=2)
    counts: collections.Counter = collections.Counter()
    seen: list = []
    model, plan = _sharded(True, counts)
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
    model.blocks[1].set_modules_to_forward_prefetch([model.blocks[2]])
    fsdp2.gate_updates(model, plan, lambda path: seen.append((path, counts[path])))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    steps = []
    with fsdp2.HostSteps(model, plan, opt):
        for it in range(2):
            counts.clear()
            steps.append(_step(model, opt, rank, it, fsdp2.clip_grad_norm_))
            sched.step()
    same = all(torch.equal(a, b) for a, b in zip(_shards(plain), _shards(model)))
    return {"seen": seen, "same": same and steps == plain_steps}


def test_forward_prefetch_of_an_offloaded_unit_waits_for_its_host_update(tmp_path):
    for rank, r in enumerate(spawn(_prefetch_worker, tmp_path)):
        assert first_gates(r["seen"]) == [("blocks.1", 0), ("blocks.2", 0)] * 2, r["seen"]
        assert r["same"], rank


def fsdp2_offload_policy(offload: bool):
    from torch.distributed.fsdp import OffloadPolicy

    return CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()


# -- the choice, pure --------------------------------------------------------------------------------------
def test_units_go_to_the_host_from_the_last_in_the_forward_the_root_last():
    units = [("", 10), ("b.0", 4), ("b.1", 4), ("b.2", 4)]
    assert choose_offloaded(units, 22) == dict.fromkeys(["", "b.0", "b.1", "b.2"], Placement.RESIDENT)
    got = choose_offloaded(units, 15)
    assert [u for u, p in got.items() if p is Placement.STREAMED] == ["b.1", "b.2"]
    got = choose_offloaded(units, 3)
    assert [u for u, p in got.items() if p is Placement.STREAMED] == ["", "b.0", "b.1", "b.2"]


def test_a_budget_no_offload_fits_says_what_to_change():
    with pytest.raises(ValueError, match="raise the budget or the world size"):
        fsdp2.offload_by_budget(_model(), -1, 2)


def test_blocks_are_the_outermost_indexed_modules():
    paths = ["", "tok", "blocks", "blocks.0", "blocks.0.fc", "blocks.1", "blocks.1.layers.0", "head"]
    assert blocks_of(paths) == ["blocks.0", "blocks.1"]
    assert fsdp2.default_units(_model()) == ["blocks.0", "blocks.1", "blocks.2"]


def test_model_state_per_unit_counts_shards_gradients_and_state():
    model = _model()
    sizes = fsdp2.unit_bytes(model, ["blocks.0", "blocks.1", "blocks.2"], 2, state_per_param=2.0)
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    assert sizes["blocks.0"] == block // 2 * 4  # shard + gradient + two moments, every dim 0 even here
    assert functools.reduce(int.__add__, sizes.values()) == sum(p.numel() for p in model.parameters()) * 4 // 2 * 4


# -- the host step on one process (HostSteps needs no process group: the units' parameters are stepped on the host
# wherever they live) ---------------------------------------------------------------------------------------------
def _one_process(host: bool, steps: int = 3, zero_in_place: bool = False):
    model = _model()
    plan = fsdp2.ShardPlan({"": Placement.RESIDENT, "blocks.0": Placement.RESIDENT, "blocks.1": Placement.STREAMED,
                            "blocks.2": Placement.STREAMED}, {})  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    host_steps = fsdp2.HostSteps(model, plan, opt) if host else None
    for it in range(steps):
        opt.zero_grad(set_to_none=not zero_in_place)
        _step(model, opt, 0, it, torch.nn.utils.clip_grad_norm_)
        sched.step()
    state = opt.state_dict()  # waits for the pending host steps
    params = [p.detach().clone() for p in model.parameters()]
    return model, opt, host_steps, params, state


def test_host_steps_on_one_process_are_bitwise_plain_with_plain_state_and_zero_grad_in_place():
    _, _, _, plain, plain_state = _one_process(False)
    for zero_in_place in (False, True):
        model, opt, host, params, state = _one_process(True, zero_in_place=zero_in_place)
        assert all(torch.equal(a, b) for a, b in zip(plain, params))
        assert state["state"].keys() == plain_state["state"].keys()
        for k, st in plain_state["state"].items():
            assert all(torch.equal(v, state["state"][k][n]) for n, v in st.items())
        assert all(p.grad is not None for p in model.parameters())  # the gradients stay, as in plain training
        with pytest.raises(RuntimeError, match="call the closure yourself"):
            opt.step(lambda: None)
        host.close()
        assert "zero_grad" not in vars(opt) and "zero_grad" not in vars(model)
