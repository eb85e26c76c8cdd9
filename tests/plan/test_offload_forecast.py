"""The model-state forecast: host profiles, buckets and their reads from a captured trace, the offload
schedules side by side, ``swap.plan(model_state=...)`` and ``python -m swap.plan --host``, on a tiny
Llama-shaped model (captured in a second)."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import swap
from swap.capture import capture
from swap.cli import main
from swap.devices import HOST_PROFILES, HostProfile, host_profile, host_step_bytes, profile
from swap.forecast.from_trace import sequence_from_trace
from swap.forecast.model_state import StateFormat, layout_from_trace, stateless_optimizer
from swap.forecast.offload import (
    DEFAULT_SCHEDULES,
    forecast_offload,
    host_kernel,
    mixed_format,
    prices_for,
    state_format,
)
from swap.forecast.zoo import llama
from swap.schedule.model_state import Bucket, Placement

MiB = 1 << 20


def tiny():
    return llama(2, 64, 4, 2, 128, 256)


def tiny_batch(n):
    tokens = torch.randint(0, 256, (n, 33))
    return {"idx": tokens[:, :-1], "labels": tokens[:, 1:]}


@pytest.fixture(scope="module")
def trace():
    return capture(tiny, tiny_batch, 4, dtype=torch.bfloat16, optimizer=stateless_optimizer)


def test_host_profiles_price_a_step_by_its_dram_bytes(tmp_path):
    # AdamW on fp32 masters: master and two states read and written (24 B), a bf16 gradient read, a bf16 copy
    # written: 28 bytes a parameter, the figure the DRAM-bound argument uses
    assert host_step_bytes("adamw", 1, 4, 2, 2) == 28 and host_step_bytes("sgd", 1, 4, 4) == 20
    desk = host_profile("desktop-ddr5-2ch")
    # 192 GB is four DIMMs, two a channel: DDR5-4000, not 5600 (the profile says which population it assumes)
    assert "4 x 48 GB" in desk.name and "DDR5-4000" in desk.name and desk.memory == 192 * 10**9
    assert desk.step_seconds("adamw", 8 * 10**9, 4, 2, 2) == pytest.approx(8e9 * 28 / (0.75 * 64e9))
    assert desk.optimizer_rate("adam") == desk.optimizer_rate("adamw") and desk.source
    # torch's default CPU kernel (the per-tensor loop) is priced slower than a single-pass one, by the ratio
    # bench/host_profile.py measured (fused 4.79 GB/s, for-loop 0.94)
    assert desk.optimizer_rate("adamw", "for-loop") == pytest.approx(desk.optimizer_rate("adamw") * 0.94 / 4.79)
    with pytest.raises(ValueError, match="unknown host optimizer kernel 'avx'"):
        desk.optimizer_rate("adamw", "avx")
    assert host_profile("server-ddr5-8ch").memory == 1 << 40 and set(HOST_PROFILES) >= {"desktop-ddr5-2ch"}
    with pytest.raises(ValueError, match="unknown host profile 'laptop'"):
        host_profile("laptop")
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        host_step_bytes("lion", 1, 4, 4)
    path = tmp_path / "host.json"  # what bench/host_profile.py writes
    path.write_text(json.dumps({"profile": {"name": "m", "dram_bandwidth": 1e10, "optimizer_rates": {"adamw": 5e9},
                                            "memory": 1 << 34, "pinnable": 1 << 33}}))  # fmt: skip
    assert host_profile(str(path)) == HostProfile("m", 1e10, {"adamw": 5e9}, 1 << 34, 1 << 33)
    # a measured profile: its own rate for each kernel it measured
    measured = host_profile(str(Path(__file__).resolve().parents[2] / "bench/results/host_profile.json"))
    assert measured.optimizer_rate("adamw", "for-loop") == pytest.approx(0.936e9, rel=0.01)


def test_buckets_in_first_use_order_and_where_they_are_read(trace):
    lay = layout_from_trace(trace, tiny, StateFormat(), bucket_bytes=16 * 1024)
    names = [p for b in lay.buckets for p in b.params]
    assert names[0] == "tok.weight" and names[-1] == "head.weight"  # the embedding is read first, the head last
    params = list(tiny().parameters())
    assert lay.params == len(params) and lay.numel() == sum(p.numel() for p in params)
    for b, u in zip(lay.buckets, lay.uses):
        assert u.forward and u.backward and max(u.forward) < u.grad_final, b.params  # read forward, then backward
    # two fp32 moments and the step counter (an fp32 scalar a parameter), as the runtime counts them
    assert lay.buckets[0].weight_bytes == 256 * 64 * 2 and lay.buckets[0].state_bytes == 256 * 64 * 8 + 4
    seq = sequence_from_trace(trace, min_bytes=0)
    assert len(lay.trace_bytes) == len(seq)
    assert all(0 <= m <= n for m, n in zip(lay.trace_bytes, seq.nonswap))  # never more than the step held
    assert min(lay.trace_bytes) >= sum(p.numel() * 2 for p in tiny().parameters())  # the bf16 weights, always


def test_every_schedule_side_by_side_within_the_budget(trace):
    dev, host = profile("rtx4090"), host_profile("desktop-ddr5-2ch")
    budget = 2 * MiB
    f = forecast_offload(trace, tiny, batch=4, tokens=128, budget=budget, dev=dev, host=host, min_bytes=0,
                         bucket_bytes=16 * 1024)  # fmt: skip
    assert set(f.results) == set(DEFAULT_SCHEDULES)
    ours = f.results["ours"]
    assert ours.fits and ours.device_peak <= budget and ours.tokens_per_s > 0
    assert ours.sim.bytes_by_kind["gradients"][1] > 0 or all(p == Placement.RESIDENT for p in ours.plan.placements)
    zero3 = f.results["zero3_offload"]
    assert zero3.fits and set(zero3.plan.placements) == {Placement.STREAMED} and zero3.timing == "blocking"
    assert "ZeRO-3-offload" in f.table() and "tokens/s" in f.table()
    assert json.loads(json.dumps(f.to_dict()))["results"]["ours"]["fits"]
    tight = forecast_offload(trace, tiny, batch=4, tokens=128, budget=budget, dev=dev, min_bytes=0,
                             host=HostProfile("small", 1e10, {"adamw": 1e10}, 10_000, 10_000),
                             schedules=("zero3_offload",))  # fmt: skip
    assert not tight.results["zero3_offload"].fits and "host memory" in tight.results["zero3_offload"].why


def test_ours_is_priced_with_only_what_the_runtime_does(trace):
    # The forecast sold speculative host steps of a few staged buckets, where faster, fp32 masters beside bf16
    # weights and a DRAM-speed AdamW for "ours"; the runtime speculates every offloaded bucket where the rollback
    # copies fit the host (Note [What the runtime runs]), keeps the parameter as the master, and runs torch's kernel.
    dev, host = profile("rtx4090"), host_profile("desktop-ddr5-2ch")
    f = forecast_offload(trace, tiny, batch=4, tokens=128, budget=2 * MiB, dev=dev, host=host, min_bytes=0,
                         bucket_bytes=16 * 1024, placement="streamed",
                         schedules=(*DEFAULT_SCHEDULES, "ours_loop", "ours_pure"))  # fmt: skip
    ours, loop, pure = (f.results[k] for k in ("ours", "ours_loop", "ours_pure"))
    for r in (ours, loop, pure):
        assert r.fits and r.timing == "speculative" and r.plan.speculate and r.sim.speculated == len(r.buckets)
    for name in DEFAULT_SCHEDULES[1:]:
        assert f.results[name].timing == "blocking" and f.results[name].sim.speculated == 0
    # the baselines' math (fp32 master and state) is an fp32 model to the runtime: fp32 weights fetched, cast on
    # the device; a bf16 model is pure bf16
    assert ours.format == "fp32 weights and gradients, fp32 master and adamw state, cast on the device"
    assert pure.format == "bf16 weights and gradients, bf16 master and adamw state, cast on the host"
    assert ours.sim.bytes_by_kind["weights"][0] > pure.sim.bytes_by_kind["weights"][0]
    # ours' host kernel is the runtime's (fused where the user left torch's default; the loop where the user
    # chose it); each baseline has its own system's
    assert (ours.kernel, loop.kernel) == ("fused", "for-loop")
    assert {k: f.results[k].kernel for k in DEFAULT_SCHEDULES[1:]} == {
        "zero_offload": "fused", "zero3_offload": "fused", "fsdp2_cpu_offload": "for-loop",
        "torchao_cpu_offload": "for-loop"}  # fmt: skip
    # the rollback copies at the host's DRAM bandwidth (read and written), the step at the kernel's rate
    save = sum(2 * (b.master_bytes + b.state_bytes) for b in ours.buckets) / host.dram_bandwidth
    assert loop.sim.host_seconds - save == pytest.approx((ours.sim.host_seconds - save) * 4.79 / 0.94)
    assert "for-loop" in f.table() and "speculative" in f.table()
    # a host whose memory holds the model state but not its rollback copies: host steps after opt.step(), as the
    # runtime does there
    every = ours.plan.host_bytes - sum(b.master_bytes + b.state_bytes for b in ours.buckets)  # less the copies
    small = replace(host, memory=ours.plan.host_bytes - 1)
    g = forecast_offload(trace, tiny, batch=4, tokens=128, budget=2 * MiB, dev=dev, host=small, min_bytes=0,
                         bucket_bytes=16 * 1024, placement="streamed", schedules=("ours",)).results["ours"]  # fmt: skip
    assert g.fits and g.timing == "before_use" and not g.plan.speculate and g.sim.speculated == 0
    assert g.plan.host_bytes == every and g.sim.host_seconds == pytest.approx(ours.sim.host_seconds - save)


def test_the_host_kernel_is_the_one_the_runtime_runs_for_the_users_optimizer():
    # swap/runtime/model_state/host_optim.py: fused where the user left torch's default, else the user's own
    assert host_kernel(None) == host_kernel(lambda p: torch.optim.AdamW(p)) == "fused"
    assert host_kernel(lambda p: torch.optim.AdamW(p, fused=True)) == "fused"
    assert host_kernel(lambda p: torch.optim.Adam(p, foreach=True)) == "foreach"
    assert host_kernel(lambda p: torch.optim.AdamW(p, foreach=False)) == "for-loop"
    assert host_kernel(lambda p: torch.optim.Adagrad(p)) == "for-loop"  # no fused CPU kernel in the runtime's list


def test_the_format_follows_the_users_optimizer_and_dtype():
    sgd = state_format(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), torch.bfloat16)
    assert (sgd.optimizer, sgd.weight, sgd.master, sgd.state) == ("sgd", 2, 4, 4)
    assert state_format(lambda p: torch.optim.SGD(p, lr=0.1), None).optimizer == "sgd_plain"
    fp32 = state_format(None, None)
    assert (fp32.optimizer, fp32.weight, fp32.master) == ("adamw", 4, 4)


def test_swap_plan_with_model_state(capsys):
    p = swap.plan(tiny, tiny_batch, budget="4MiB", device="rtx4090", model_state=swap.ModelStatePolicy(),
                  host="desktop-ddr5-2ch", batch=2, policies=("none",), strategies=(), dtype=torch.bfloat16,
                  min_bytes=0, progress=False)  # fmt: skip
    assert p.model_state is not None and p.model_state.results["ours"].fits and p.model_state.tokens == 64
    assert "model state under the budget" in p.table() and p.to_dict()["model_state"]["batch"] == 2
    with pytest.raises(ValueError, match="needs a host profile"):
        swap.plan(tiny, tiny_batch, budget="4MiB", model_state=swap.ModelStatePolicy(), batch=2, progress=False)
    with pytest.raises(ValueError, match="pass batch=N"):
        swap.plan(tiny, tiny_batch, budget="4MiB", host="desktop-ddr5-2ch", progress=False)
    with pytest.raises(ValueError, match="unknown placement 'all'"):
        swap.plan(tiny, tiny_batch, budget="4MiB", model_state=swap.ModelStatePolicy(placement="all"),
                  host="desktop-ddr5-2ch", batch=2, progress=False)  # fmt: skip
    # the old spelling, a string, still works and says the new one (Note [The model-state policy])
    with pytest.warns(FutureWarning, match=r"model_state=swap.ModelStatePolicy\(placement='streamed'\)"):
        with pytest.raises(ValueError, match="needs a host profile"):
            swap.plan(tiny, tiny_batch, budget="4MiB", model_state="offload", batch=2, progress=False)
    # mixed precision (Note [Mixed precision pricing]) is priced as the runtime trains it, no longer refused
    mixed = swap.plan(tiny, tiny_batch, budget="4MiB", device="rtx4090",
                      model_state=swap.ModelStatePolicy(compute_dtype=torch.bfloat16), host="desktop-ddr5-2ch",
                      batch=2, policies=("none",), strategies=(), min_bytes=0, progress=False)  # fmt: skip
    ours, pure = mixed.model_state.results["ours"], p.model_state.results["ours"]
    assert ours.fits and ours.format.startswith("mixed bf16 compute / fp32 master")
    assert all(b.mixed for b in ours.buckets) and "resident" not in {pl.value for pl in ours.plan.placements}
    n = sum(b.numel for b in ours.buckets)
    assert sum(b.weight_bytes for b in ours.buckets) == sum(b.weight_bytes for b in pure.buckets) == 2 * n
    # bf16 weights in and bf16 gradients out, as the pure bf16 model's; fp32 master, gradients and state on the host
    assert ours.plan.host_bytes > pure.plan.host_bytes + 2 * 4 * n
    for refused, match in ((dict(dtype=torch.bfloat16), "keeps fp32 masters"),
                           (dict(placement="resident"), "placement='auto' or 'streamed'")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            swap.plan(tiny, tiny_batch, budget="4MiB", host="desktop-ddr5-2ch", batch=2, progress=False,
                      dtype=refused.get("dtype"), model_state=swap.ModelStatePolicy(
                          placement=refused.get("placement", "auto"), compute_dtype=torch.bfloat16))  # fmt: skip


USER_FILE = """
import torch
from swap.forecast.zoo import llama

def model_fn():
    return llama(2, 64, 4, 2, 128, 256)

def batch_fn(n):
    tokens = torch.randint(0, 256, (n, 33))
    return {"idx": tokens[:, :-1], "labels": tokens[:, 1:]}
"""


def test_the_command_line_takes_a_host(tmp_path, capsys):
    f = tmp_path / "m.py"
    f.write_text(USER_FILE)
    base = ["--model", f"{f}:model_fn", "--batch", f"{f}:batch_fn", "--budget", "4MiB", "--device", "rtx4090",
            "--quiet", "--strategies", "off", "--policies", "none", "--min-bytes", "1",
            "--dtype", "bfloat16"]  # fmt: skip
    assert main(base + ["--host", "desktop-ddr5-2ch", "--at-batch", "2", "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "model state under the budget" in out and "ZeRO-Offload" in out
    assert json.loads((tmp_path / "p.json").read_text())["model_state"]["host"].startswith("desktop")
    for bad, message in ((["--host", "desktop-ddr5-2ch"], "pass --at-batch N"),
                         (["--model-state", "offload", "--at-batch", "2"], "--model-state needs --host")):  # fmt: skip
        with pytest.raises(SystemExit):
            main(base + bad)
        assert message in capsys.readouterr().err


def test_a_recompute_plan_says_where_each_step_went(trace):
    from swap.forecast.ops_from_trace import table_from_trace
    from swap.joint.regions import RecomputePlan, Region, apply_regions

    seq = sequence_from_trace(trace, min_bytes=0)
    table = table_from_trace(trace, min_bytes=0)
    for plan in (RecomputePlan(), RecomputePlan((Region("blocks.0"),)), RecomputePlan((Region("blocks.1"),), True)):
        m = apply_regions(seq, table, plan)
        assert len(m.holds) == len(seq) and m.holds == sorted(m.holds)  # every step, in order
        assert all(0 <= h < len(m.sequence) for h in m.holds)
        kept = [i for i in range(len(seq)) if i == 0 or m.holds[i] != m.holds[i - 1]]
        for i in kept[1:]:  # a step that kept its own entry is that entry
            if seq.kind[i] == "use" and not plan.regions:
                assert m.sequence.kind[m.holds[i]] == "use"
    whole = apply_regions(seq, table, RecomputePlan((Region("blocks.0"),)))
    assert len(set(whole.holds)) < len(seq)  # the checkpointed block's saves joined the steps before them


def test_mixed_precision_host_work_is_the_runtimes():
    """Note [Mixed precision pricing]: the fp32 AdamW step reads fp32 gradients after each arriving bf16 one is
    upcast (2 bytes read, 4 written a parameter), and every fetch casts the fp32 master into the bf16 copy on the
    thread that runs the model (the compute stream), which the pure formats do not."""
    host, dev = host_profile("desktop-ddr5-2ch"), profile("rtx4090")
    fmt = mixed_format(None, torch.bfloat16)
    assert (fmt.weight, fmt.master, fmt.grad, fmt.state, fmt.cast, fmt.mixed) == (2, 4, 2, 4, "host", True)
    n = 1 << 20
    b = Bucket(0, ("w",), n, 2 * n, 4 * n, 2 * n, 8 * n + 4, mixed=True)
    prices = prices_for([b], fmt, dev, host)
    rate = host.optimizer_rate("adamw", "fused")
    assert prices.host_step_bytes == (host_step_bytes("adamw", n, 4, 4, 2) + 6 * n,)
    assert prices.host_step_seconds == (prices.host_step_bytes[0] / rate,)
    assert prices.cast_seconds == (6 * n / rate,)
    pure = prices_for([b], state_format(None, torch.bfloat16), dev, host)
    assert pure.cast_seconds == () and pure.host_step_bytes[0] < prices.host_step_bytes[0]
