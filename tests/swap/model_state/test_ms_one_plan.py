"""One model-state plan (issue 37 item 1): the forecast (``swap.plan``'s path: a capture on the meta device, its
parameters packed by swap/schedule/model_state/) and the runtime (``SwapManager``'s: the user's storages, packed by
the same room) make the same buckets, predict the same host bytes and place the same way for the same room; and
``swap.ModelStatePolicy`` is what every entry point takes, the old spellings warning."""

import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn

import swap
from swap.capture import capture
from swap.devices import host_profile, profile
from swap.forecast.model_state import stateless_optimizer
from swap.forecast.offload import forecast_offload
from swap.schedule.model_state import ModelStatePolicy, Placement, plan_model_state
from swap.schedule.model_state.choice import with_speculation

BUDGET = 1 << 30


def stack(d: int) -> nn.Module:
    """An nn.Sequential MLP of width ``d`` (and ``2 d`` inside), seeded."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d), nn.GELU(), nn.Linear(d, 2 * d), nn.GELU(),
                         nn.Linear(2 * d, d), nn.LayerNorm(d), nn.Linear(d, d))  # fmt: skip


def model_fn() -> nn.Module:
    # every parameter a multiple of 512 bytes in fp32, the host pool's alignment: the runtime's prediction is then
    # exactly the bytes the plan counts
    return stack(128)


def batch_fn(n: int):
    return torch.randn(n, 128), torch.randint(0, 128, (n,))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def run(policy: ModelStatePolicy, steps: int = 3) -> swap.SwapManager:
    model = model_fn()
    opt = adamw(model.parameters())
    x, y = batch_fn(8)
    with swap.SwapManager(budget=BUDGET, device="cpu", policy="window", model=model, optimizer=opt,
                          model_state=policy) as sm:  # fmt: skip
        for _ in range(steps):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return sm


@pytest.fixture(scope="module")
def forecast():
    trace = capture(model_fn, batch_fn, 8, optimizer=stateless_optimizer, target="cpu")
    f = forecast_offload(trace, model_fn, batch=8, tokens=8, budget=BUDGET, dev=profile("rtx4090"),
                         host=host_profile("desktop-ddr5-2ch"), schedules=("ours",), placement="streamed",
                         min_bytes=0)  # fmt: skip
    return f.results["ours"]


def test_forecast_and_runtime_make_the_same_buckets_and_host_bytes(forecast):
    sm = run(ModelStatePolicy(placement="streamed"))
    ms = sm.report()["model_state"]
    assert ms["mode"] == "streamed" and ms["placements"] == {"streamed": ms["buckets"]}
    runtime = [(tuple(b["params"]), b["weight_bytes"], b["grad_bytes"], b["state_bytes"]) for b in ms["bucket_specs"]]
    planned = [(b.params, b.weight_bytes, b.grad_bytes, b.state_bytes) for b in forecast.buckets]
    assert len(planned) > 3  # the default bucket size (Note [Bucket size by default]) splits this model
    assert planned == runtime
    # the forecast's host bytes of an all-streamed plan are what the runtime predicted (with the rollback copies of
    # its speculative host steps: both speculate, the host has room for them), and allocated (all but the
    # accumulation buffer, taken only when a backward adds to a gradient not yet stepped: none here)
    assert set(forecast.plan.placements) == {Placement.STREAMED}
    assert forecast.timing == "speculative" and sm.model_state.speculate
    assert forecast.plan.host_bytes == ms["host_bytes_predicted"] + ms["speculation"]["rollback_bytes_predicted"]
    assert ms["host_bytes"] == ms["host_bytes_predicted"] - sm.model_state.prediction.accumulation > 0


def forecast_on(host_memory: int):
    """The all-streamed forecast of ``model_fn`` with ``host_memory`` bytes of host memory."""
    trace = capture(model_fn, batch_fn, 8, optimizer=stateless_optimizer, target="cpu")
    host = replace(host_profile("desktop-ddr5-2ch"), memory=host_memory)
    return forecast_offload(trace, model_fn, batch=8, tokens=8, budget=BUDGET, dev=profile("rtx4090"), host=host,
                            schedules=("ours",), placement="streamed", min_bytes=0).results["ours"]  # fmt: skip


def test_forecast_and_runtime_speculate_alike_and_predict_the_copies():
    """Issue 37 item 5: the forecast speculates exactly where the runtime does (Note [When to speculate]: the
    rollback copies of every offloaded parameter fit beside the model state), with the runtime's bytes
    (``ledger.rollback_bytes``): on a host with room, both speculate every bucket and the forecast's host bytes are
    the runtime's prediction with its copies, the copies the runtime took at most; on a host one byte short of
    them, neither speculates and the forecast's host bytes are the prediction alone."""
    sm = run(ModelStatePolicy(placement="streamed"))
    ms, pred = sm.report()["model_state"], sm.model_state.prediction
    spec = ms["speculation"]
    assert sm.model_state.speculate and spec["on"] and spec["speculated"] >= ms["buckets"] and spec["kept"] > 0
    assert spec["rollback_bytes_predicted"] == pred.rollback > 0
    assert spec["rollback_bytes_peak"] == pred.rollback  # every bucket speculated before opt.step() confirmed any
    roomy = forecast_on(pred.total + pred.rollback)  # exactly room: the runtime's rule is <=
    assert roomy.timing == "speculative" and roomy.plan.speculated() == list(range(len(roomy.buckets)))[::-1]
    assert roomy.plan.host_bytes == pred.total + pred.rollback and roomy.sim.speculated == len(roomy.buckets)
    short = pred.total + pred.rollback - 1
    sm = run(ModelStatePolicy(placement="streamed", host_memory=short))
    ms = sm.report()["model_state"]
    assert not sm.model_state.speculate and not ms["speculation"]["on"] and ms["speculation"]["speculated"] == 0
    assert any("no speculative host steps" in note for note in ms["notes"])
    tight = forecast_on(short)
    assert tight.fits and tight.timing == "before_use" and not tight.plan.speculate and tight.sim.speculated == 0
    assert tight.plan.host_bytes == pred.total == ms["host_bytes_predicted"]


def test_the_runtime_places_as_the_plan_does_for_its_room(forecast):
    sm = run(ModelStatePolicy())  # placement="auto": chosen once the activations are planned
    applied = sm.model_state.plan
    assert applied is not None and applied.room > 0
    # the chooser's (Note [One chooser]): the room and resident share it kept, placed by the forecast's buckets
    choice = sm.report()["model_state"]["choice"]
    assert choice["chooser"] == "choose_model_state" and choice["plan_room"] == applied.room
    again = plan_model_state(forecast.buckets, applied.room, placement="auto",
                             resident_room=int(choice["resident_share"] * applied.room),
                             accumulation=sm.model_state.prediction.accumulation)  # fmt: skip
    assert again.placements == applied.placements
    assert (again.device_bytes, again.host_bytes, again.pinned_bytes) == \
        (applied.device_bytes, applied.host_bytes, applied.pinned_bytes)  # fmt: skip


def mixed_model_fn() -> nn.Module:
    # every parameter a multiple of 256 elements: 512 bytes in bf16 (the compute copies, pinned, and the gradients
    # as they arrive), the host pool's alignment, so the runtime's prediction is exactly the bytes the plan counts
    return stack(256)


def mixed_batch_fn(n: int):
    return torch.randn(n, 256), torch.randint(0, 256, (n,))


def mixed_forecast(placement: str):
    """``swap.plan``'s model-state forecast of ``mixed_model_fn`` under ``ModelStatePolicy(compute_dtype=bf16)``
    (Note [Mixed precision pricing]): the capture in bf16, ours in the runtime's mixed format."""
    from swap.forecast.offload import forecast_model

    return forecast_model(mixed_model_fn, mixed_batch_fn, None, batch=8, budget=BUDGET, dev=profile("rtx4090"),
                          host=host_profile("desktop-ddr5-2ch"), optimizer=adamw, min_bytes=0, target="cpu",
                          policy=ModelStatePolicy(placement=placement, compute_dtype=torch.bfloat16)).results["ours"]


def run_mixed(policy: ModelStatePolicy, steps: int = 3) -> swap.SwapManager:
    model = mixed_model_fn()
    opt = adamw(model.parameters())
    x, y = mixed_batch_fn(8)
    with swap.SwapManager(budget=BUDGET, device="cpu", policy="window", model=model, optimizer=opt,
                          model_state=policy) as sm:  # fmt: skip
        for _ in range(steps):
            nn.functional.cross_entropy(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()
    return sm


def test_forecast_and_runtime_agree_on_mixed_precision_bytes():
    """Issue 37: under ``compute_dtype=torch.bfloat16`` the forecast's buckets and host, pinned and state bytes are
    what ``SwapManager`` predicts and measures for the same model (the ledger's ``predict_host`` on both sides)."""
    forecast = mixed_forecast("streamed")
    sm = run_mixed(ModelStatePolicy(placement="streamed", compute_dtype=torch.bfloat16))
    ms = sm.report()["model_state"]
    pred = sm.model_state.prediction
    assert ms["precision"] == "mixed bf16 compute / fp32 master" and pred.mixed
    runtime = [(tuple(b["params"]), b["weight_bytes"], b["master_bytes"], b["grad_bytes"], b["state_bytes"],
                b["mixed"]) for b in ms["bucket_specs"]]  # fmt: skip
    planned = [(b.params, b.weight_bytes, b.master_bytes, b.grad_bytes, b.state_bytes, b.mixed)
               for b in forecast.buckets]  # fmt: skip
    assert len(planned) > 3 and planned == runtime
    n = sum(b.numel for b in forecast.buckets)
    assert sum(b.weight_bytes for b in forecast.buckets) == 2 * n  # bf16 compute copies, bf16 gradients
    assert sum(b.master_bytes for b in forecast.buckets) == 4 * n
    assert set(forecast.plan.placements) == {Placement.STREAMED}
    # host: fp32 masters, fp32 gradient buffers, fp32 AdamW state, bf16 copies, the accumulation buffer; every
    # gradient arrives through the buffer (it is upcast), so all of it is allocated
    assert forecast.plan.host_bytes == ms["host_bytes_predicted"] + pred.rollback  # both speculate: Note [Rollback
    assert ms["host_bytes_predicted"] == pred.total == ms["host_bytes"]  # copies]: the fp32 master and its state
    assert forecast.timing == "speculative" and sm.model_state.speculate and pred.rollback == 4 * n + pred.state
    assert pred.grads == 4 * n and pred.copies == 2 * n
    assert forecast.plan.pinned_bytes == pred.pinned == pred.copies + pred.accumulation
    assert sum(b.state_bytes for b in forecast.buckets) == ms["state_bytes_predicted"] == ms["state_bytes"]
    # the link: bf16 gradients out, 2 bytes a parameter, in the simulated step as in the run
    assert forecast.sim.bytes_by_kind["gradients"][1] == 2 * n == ms["steps"][-1]["grads_out_bytes"]


def test_mixed_precision_keeps_no_bucket_resident_in_either_plan():
    """Note [Mixed precision]: the shared placer makes no mixed bucket resident, for the runtime and the forecast;
    the room that would hold every bucket resident in fp32 holds them as host masters."""
    forecast = mixed_forecast("auto")
    assert Placement.RESIDENT not in forecast.plan.placements
    sm = run_mixed(ModelStatePolicy(compute_dtype=torch.bfloat16))
    applied = sm.model_state.plan
    assert applied is not None and Placement.HOST_MASTER in applied.placements
    assert Placement.RESIDENT not in applied.placements
    assert not any("made resident are host masters" in note for note in applied.notes)  # planned so, not converted
    # the chooser's room and resident share (Note [One chooser]), its host steps speculative where the runtime's are
    choice, accumulation = sm.report()["model_state"]["choice"], sm.model_state.prediction.accumulation
    assert choice["chooser"] == "choose_model_state" and applied.speculate == sm.model_state.speculate
    again = plan_model_state(forecast.buckets, applied.room, placement="auto",
                             resident_room=int(choice["resident_share"] * applied.room),
                             accumulation=accumulation)  # fmt: skip
    if applied.speculate:
        again = with_speculation(forecast.buckets, again, None, accumulation=accumulation)
    assert again.placements == applied.placements
    assert (again.device_bytes, again.host_bytes, again.pinned_bytes) == \
        (applied.device_bytes, applied.host_bytes, applied.pinned_bytes)  # fmt: skip
    with pytest.raises(ValueError, match="placement='auto' or 'streamed'"):
        plan_model_state(forecast.buckets, BUDGET, placement="resident")


def test_the_policy_is_taken_without_a_warning_and_validated():
    model = model_fn()
    opt = adamw(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        sm = swap.SwapManager(budget=BUDGET, device="cpu", model=model, optimizer=opt,
                              model_state=swap.ModelStatePolicy(placement="streamed", bucket_bytes="64KiB",
                                                                host_memory="1GiB", host_threads=1))  # fmt: skip
    assert sm.model_state.policy == ModelStatePolicy("streamed", 64 << 10, 1 << 30, None, 1)
    assert sm.model_state.bucket_bytes == 64 << 10
    resident = swap.SwapManager(budget=BUDGET, device="cpu", model=model, optimizer=opt,
                                model_state=ModelStatePolicy(placement="resident"))  # fmt: skip
    assert resident.model_state is None  # the state stays the user's, on the device
    with pytest.raises(ValueError, match="unknown placement 'gpu': choose one of 'auto', 'resident'"):
        ModelStatePolicy(placement="gpu")
    with pytest.raises(ValueError, match="bucket_bytes"):
        ModelStatePolicy(bucket_bytes=0)
    with pytest.raises(ValueError, match="host_threads must be a positive int"):
        ModelStatePolicy(host_threads=0)
    with pytest.raises(ValueError, match="compute_dtype must be torch.bfloat16 or torch.float16"):
        ModelStatePolicy(compute_dtype=torch.int8)
    with pytest.raises(TypeError, match="model_state must be a swap.ModelStatePolicy"):
        swap.SwapManager(budget=BUDGET, device="cpu", model=model, optimizer=opt, model_state=3)
    with pytest.raises(ValueError, match="given both as an argument and in the policy"):
        swap.SwapManager(budget=BUDGET, device="cpu", model=model, optimizer=opt, bucket_bytes="1MiB",
                         model_state=ModelStatePolicy(bucket_bytes="64KiB"))  # fmt: skip
    with pytest.raises(TypeError, match="compute_dtype must be a torch.dtype"):
        ModelStatePolicy(compute_dtype="bf16")
    # the policy's compute dtype is the manager's compute_dtype= (Note [Mixed precision]); given both ways, they agree
    mixed = swap.SwapManager(budget=BUDGET, device="cpu", model=model, optimizer=opt,
                             model_state=ModelStatePolicy(placement="streamed", compute_dtype=torch.bfloat16))
    assert mixed.model_state.compute_dtype == torch.bfloat16 and mixed.model_state.prediction.mixed
    with pytest.raises(ValueError, match="disagree: give it once"):
        swap.SwapManager(budget=BUDGET, device="cpu", model=model, optimizer=opt, compute_dtype=torch.float16,
                         model_state=ModelStatePolicy(compute_dtype=torch.bfloat16))  # fmt: skip
    with pytest.raises(FutureWarning, match="placement='offload' is now spelled 'streamed'"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            ModelStatePolicy(placement="offload")


def test_old_spellings_keep_working_and_name_the_new_one():
    model = model_fn()
    opt = adamw(model.parameters())
    with pytest.warns(FutureWarning, match=r"model_state=swap.ModelStatePolicy\(placement='streamed'\)"):
        sm = swap.SwapManager(budget=BUDGET, device="cpu", model=model, optimizer=opt, model_state="offload")
    assert sm.model_state.mode == "streamed"
    with pytest.warns(FutureWarning, match=r"model_state=swap.ModelStatePolicy\(bucket_bytes='64KiB'\)"):
        sm = swap.SwapManager(budget=BUDGET, device="cpu", model=model, optimizer=opt, bucket_bytes="64KiB")
    assert sm.model_state.policy.bucket_bytes == 64 << 10 and sm.model_state.mode == "auto"
    with pytest.warns(FutureWarning, match=r"ModelStatePolicy\(host_memory=1073741824\)"):
        swap.SwapManager(budget=BUDGET, device="cpu", model=model, optimizer=opt, host_memory=1 << 30)


def test_the_fsdp2_path_takes_the_policy():
    model = model_fn()
    streamed = ModelStatePolicy(placement="streamed")
    plan = swap.fsdp2.offload_by_budget(model, BUDGET, 2, policy=streamed)
    assert plan.policy is streamed and set(plan.placements.values()) == {Placement.STREAMED}
    assert not swap.fsdp2.offload_by_budget(model, BUDGET, 2).offloaded  # "auto": the room holds every unit
    sizes = swap.fsdp2.unit_bytes(model, swap.fsdp2.default_units(model), 2)
    last = swap.fsdp2.default_units(model)[-1]
    tight = swap.fsdp2.offload_by_budget(model, sum(sizes.values()) - 1, 2)  # one byte short: the last unit goes
    assert tight.offloaded == [last]
    with pytest.raises(swap.HostMemoryError, match="the policy's host_memory is 1.00 KiB"):
        swap.fsdp2.offload_by_budget(model, BUDGET, 2, policy=ModelStatePolicy(placement="streamed", host_memory=1024))
    with pytest.raises(NotImplementedError, match="keeps no device copy"):
        swap.fsdp2.offload_by_budget(model, BUDGET, 2, policy=ModelStatePolicy(placement="host_master"))
    with pytest.raises(ValueError, match="a bucket is a unit"):
        swap.fsdp2.offload_by_budget(model, BUDGET, 2, policy=ModelStatePolicy(bucket_bytes="1MiB"))
