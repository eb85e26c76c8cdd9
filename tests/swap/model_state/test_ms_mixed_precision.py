"""Mixed precision (``compute_dtype=torch.bfloat16``, Note [Mixed precision] in
swap/runtime/model_state/precision.py) is bitwise a reference loop written here as FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` runs one rank: fp32 masters, bf16 copies for the
forward and backward, each backward's bf16 gradient upcast and accumulated in fp32, clipping over the fp32
gradients, an fp32 AdamW step with the host's kernel; the reference is itself FSDP2's result, bitwise, on one gloo
rank. Streamed and host-master placements (a plan's resident buckets become host masters), every iteration within
the budget as the independent SweepMeter sees it."""

import contextlib
import copy
import functools
import sys
from pathlib import Path

import pytest
import torch
from ms_training import assert_bitwise, batch, gpt, groups, host_kernel, loss_of, state_arrays, train
from ms_training import copy as array
from torch.utils._python_dispatch import TorchDispatchMode

import swap
from swap.schedule.model_state import ModelStatePlan, Placement, UpdateSite

sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests/swap: sweep_meter, the budget's judge
from sweep_meter import SweepMeter  # noqa: E402

BF16 = torch.bfloat16
STEPS, ACCUM = 3, 2


class DeviceSweep(SweepMeter):
    """The SweepMeter, told which memory is the host's. On a CPU run host and device are one address space, and
    the host buffers (masters, gradients, staging: the managers' host pools) are host memory that the manager's
    budget rightly leaves out; the sweep would count one as soon as an operator on this thread reads it (clipping
    reads the host gradients). Storages inside a host pool's blocks are not counted; everything else is."""

    def __init__(self):
        super().__init__("cpu")
        self.managers = []

    def _host(self, t):
        ptr = t.untyped_storage().data_ptr()
        for sm in self.managers:
            ms = sm.model_state
            pools = [*(ms.pools if ms is not None else ()), *([sm.executor.pool] if sm.executor else ())]
            for pool in pools:
                if any(b.ctypes.data <= ptr < b.ctypes.data + b.size for b in pool._blocks):
                    return True
        return False

    def _note(self, t):
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided and self._host(t):
            return
        super()._note(t)


def adamw(model):
    return torch.optim.AdamW(groups(model), lr=3e-3, weight_decay=0.1)


def run(compute=BF16, build=gpt, manager=None, scaler=False, steps=STEPS, accum=ACCUM):
    """The loop, with ``manager(model, opt)`` (a SwapManager) or, without one, the oracle: fp32 masters (the model,
    stepped by AdamW with the host's kernel), a compute copy cast from them before each micro-batch, its
    gradients upcast and added to the masters' in fp32, clipping on the masters; ``scaler``: a GradScaler."""
    torch.manual_seed(0)
    model = build()
    opt = adamw(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**12) if scaler else None
    shadow, pairs = None, []
    if manager is None:
        host_kernel(opt)
        shadow = copy.deepcopy(model).to(compute)
        pairs = list(zip(model.parameters(), shadow.parameters()))
    losses, norms = [], []
    with manager(model, opt) if manager is not None else contextlib.nullcontext():
        for step in range(steps):
            opt.zero_grad()
            for micro in range(accum):
                with torch.no_grad():
                    for master, c in pairs:
                        c.copy_(master)
                x, y = batch(model, step * 100 + micro)
                loss = loss_of(shadow if shadow is not None else model, x, y)
                part = loss / accum
                (sc.scale(part) if sc is not None else part).backward()
                losses.append(loss.item())
                for master, c in pairs:
                    if c.grad is not None:
                        g = c.grad.float()
                        master.grad = g if master.grad is None else master.grad.add_(g)
                        c.grad = None
            if sc is not None:
                sc.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())
            if sc is not None:
                sc.step(opt)
                sc.update()
            else:
                opt.step()
            sched.step()
    return {"losses": losses, "norms": norms, "params": [array(p) for p in model.parameters()],
            "grads": [array(p.grad) for p in model.parameters()], "state": state_arrays(opt.state_dict())}  # fmt: skip


def reference():
    return run()


@functools.cache
def oracle():
    return reference()


def test_the_reference_is_fsdp2_mixed_precision_on_one_rank():
    """The oracle is FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: fully_shard on one gloo
    rank, in this process, gives the same losses, clip norms, parameters and gradients to the bit."""
    dist = pytest.importorskip("torch.distributed")
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, not initialised already")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = gpt()
        fsdp.fully_shard(model, mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32))
        opt = torch.optim.AdamW(groups(model), lr=3e-3, weight_decay=0.1, fused=True)  # the host's kernel
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
        losses, norms = [], []
        for step in range(STEPS):
            opt.zero_grad()
            for micro in range(ACCUM):
                x, y = batch(model, step * 100 + micro)
                loss = loss_of(model, x, y)
                (loss / ACCUM).backward()
                losses.append(loss.item())
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).full_tensor().item())
            opt.step()
            sched.step()
        params = [array(p.full_tensor()) for p in model.parameters()]
        grads = [array(p.grad.full_tensor()) for p in model.parameters()]
    finally:
        dist.destroy_process_group()
    ref = oracle()
    assert losses == ref["losses"] and norms == ref["norms"]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(params, ref["params"]))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(grads, ref["grads"]))


@functools.cache
def budget():
    """30 % of plain fp32 training's peak, as the SweepMeter sees it: less than the fp32 weights, gradients and
    AdamW state alone."""
    meter = SweepMeter("cpu")
    train(gpt, meter=meter)
    n = sum(p.numel() for p in gpt().parameters())
    b = int(0.3 * meter.peak)
    assert 16 * n > b
    return b


def manager(model_state="offload", holder=None, meter=None):
    def make(model, opt):
        sm = swap.SwapManager(budget=budget(), device="cpu", model=model, optimizer=opt, model_state=model_state,
                              bucket_bytes="32KiB", min_bytes="4KiB", compute_dtype=BF16)  # fmt: skip
        if holder is not None:
            holder["sm"] = sm
        if meter is not None:
            meter.managers.append(sm)
        return sm

    return make


def metered_run(model_state="offload", holder=None, **kw):
    meter = DeviceSweep()
    return train(gpt, "adamw", STEPS, ACCUM, manager=manager(model_state, holder, meter), meter=meter, **kw)


def within_budget(got):
    over = [(i, p - budget()) for i, p in enumerate(got["peaks"]) if p > budget()]
    assert not over, f"iterations over the budget of {budget()} bytes: {over}; peaks {got['peaks']}"


def test_offloaded_is_bitwise_the_reference_and_within_the_budget():
    got = metered_run()
    assert_bitwise(oracle(), got)
    within_budget(got)
    assert len(got["peaks"]) == STEPS * ACCUM
    model_params = [p for p in gpt().parameters()]
    r = got["manager"].report()["model_state"]
    assert r["precision"] == "mixed bf16 compute / fp32 master"
    assert r["placements"] == {"streamed": r["buckets"]} and r["buckets"] > 1
    # The link carries bf16: each backward's gradients, 2 bytes a parameter.
    n = sum(p.numel() for p in model_params)
    assert [row["grads_out_bytes"] for row in r["steps"]] == [ACCUM * 2 * n] * STEPS
    assert r["host_bytes"] == r["host_bytes_predicted"]


def test_a_plans_resident_buckets_are_host_masters_and_the_run_stays_bitwise():
    holder = {}

    def propose(step, model, opt, sched):
        if step == 0:
            ms = holder["sm"].model_state
            n = len(ms.streamer.buckets)
            placements = [Placement.RESIDENT] * (n // 3) + [Placement.HOST_MASTER] * (n // 3)
            placements += [Placement.STREAMED] * (n - len(placements))
            ms.propose(ModelStatePlan(placements, [UpdateSite.DEVICE if p == Placement.RESIDENT else UpdateSite.HOST
                                                   for p in placements]))  # fmt: skip

    got = metered_run(holder=holder, step_hook=propose)
    assert_bitwise(oracle(), got)
    within_budget(got)
    r = got["manager"].report()["model_state"]
    n = r["buckets"]
    assert r["placements"] == {"host_master": 2 * (n // 3), "streamed": n - 2 * (n // 3)}
    assert r["steps"][2]["weights_in_bytes"] < r["steps"][0]["weights_in_bytes"]  # host masters keep their copy


def test_auto_by_default_is_bitwise_the_reference_and_within_the_budget():
    got = metered_run("auto")
    assert_bitwise(oracle(), got)
    within_budget(got)
    assert "resident" not in got["manager"].report()["model_state"]["placements"]


def test_the_model_is_fp32_masters_after_and_bf16_inside():
    seen = {}

    def look(step, model, opt, sched):
        seen["dtypes"] = {p.dtype for p in model.parameters()}
        seen["grad"] = model.head.weight.grad.dtype  # the host gradient: fp32
        seen["saved"] = {v.dtype for v in model.state_dict().values() if v.is_floating_point()}

    got = train(gpt, "adamw", 1, ACCUM, manager=manager(), step_hook=look)
    assert seen == {"dtypes": {BF16}, "grad": torch.float32, "saved": {torch.float32}}
    assert {str(p.dtype) for p in got["params"]} == {"float32"}  # after the manager: the fp32 masters


class Casts(TorchDispatchMode):
    """Counts dtype casts (``aten._to_copy``) whose input is one of ``storages``."""

    def __init__(self, storages):
        super().__init__()
        self.storages, self.count = storages, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].untyped_storage()._cdata in self.storages:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("compute_dtype", [BF16, None])
def test_autocast_on_top_casts_no_streamed_weight(compute_dtype):
    """Under ``torch.autocast`` the bf16 compute copies are what autocast wants: no weight is cast, so its cache
    holds no copy of a streamed weight. Without compute_dtype (fp32 weights streamed) it casts every one, which
    shows the check sees casts."""
    torch.manual_seed(0)
    model = gpt()
    opt = adamw(model)
    with swap.SwapManager(budget="1GiB", device="cpu", model=model, optimizer=opt, model_state="offload",
                          bucket_bytes="32KiB", compute_dtype=compute_dtype) as sm:  # fmt: skip
        storages = {e.key for e in sm.model_state.entries}
        for step in range(2):
            x, y = batch(model, step)
            with Casts(storages) as casts, torch.autocast("cpu", dtype=BF16):
                loss = loss_of(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            assert torch.isfinite(loss)
            if compute_dtype is None:
                assert casts.count > 0
            else:
                assert casts.count == 0


def test_host_memory_counts_fp32_masters_and_the_bf16_copies():
    torch.manual_seed(0)
    model = gpt()
    n = sum(p.numel() for p in model.parameters())
    sm = swap.SwapManager(budget="1GiB", device="cpu", model=model, optimizer=adamw(model), model_state="offload",
                          bucket_bytes="32KiB", compute_dtype=BF16)  # fmt: skip
    pred = sm.model_state.prediction
    slack = 512 * len(list(model.parameters()))  # the host pool's alignment, at most a block's worth each
    assert 4 * n <= pred.masters <= 4 * n + slack and 4 * n <= pred.grads <= 4 * n + slack
    assert 2 * n <= pred.copies <= 2 * n + slack and pred.state >= 8 * n
    assert pred.pinned == pred.copies + pred.accumulation  # only what the link reads and writes is page-locked
    with pytest.raises(swap.HostMemoryError, match="compute-dtype copies"):
        swap.SwapManager(budget="1GiB", device="cpu", model=model, optimizer=adamw(model), model_state="offload",
                         compute_dtype=BF16, host_memory=pred.total - 1)  # fmt: skip


def test_the_report_names_the_format():
    def precision(dtype, compute_dtype):
        model = gpt().to(dtype)
        sm = swap.SwapManager(budget="1GiB", device="cpu", model=model, optimizer=adamw(model),
                              compute_dtype=compute_dtype)  # fmt: skip
        return sm.report()["model_state"]["precision"]

    assert precision(torch.float32, BF16) == "mixed bf16 compute / fp32 master"
    assert precision(torch.float32, torch.float16) == "mixed fp16 compute / fp32 master"
    assert precision(BF16, None) == "bf16"  # pure bf16: masters and state in bf16, as asked for by the model
    assert precision(torch.float32, None) == "fp32"


@pytest.mark.parametrize("kw, error, match", [
    ({"compute_dtype": torch.int8}, ValueError, "not a half-precision float dtype"),
    ({"compute_dtype": torch.float32}, ValueError, "needs no compute_dtype"),
    ({"compute_dtype": "bf16"}, TypeError, "must be a torch.dtype"),
    ({"compute_dtype": BF16, "model_state": "resident"}, ValueError, "placement='auto' or 'streamed'"),
    ({"compute_dtype": BF16, "bf16_model": True}, ValueError, "already in half precision"),
    ({"compute_dtype": BF16, "no_model": True}, ValueError, "needs model= and optimizer="),
])  # fmt: skip
def test_bad_input_says_what_to_change(kw, error, match):
    kw = dict(kw)
    model = gpt().to(BF16) if kw.pop("bf16_model", False) else gpt()
    given = {} if kw.pop("no_model", False) else {"model": model, "optimizer": adamw(model)}
    with pytest.raises(error, match=match):
        swap.SwapManager(budget="1GiB", device="cpu", **given, **kw)


def test_grad_scaler_with_bf16_is_refused():
    torch.manual_seed(0)
    model = gpt()
    opt = adamw(model)
    scaler = torch.amp.GradScaler("cpu")
    with swap.SwapManager(budget="1GiB", device="cpu", model=model, optimizer=opt, model_state="offload",
                          compute_dtype=BF16):  # fmt: skip
        x, y = batch(model, 0)
        scaler.scale(loss_of(model, x, y)).backward()
        with pytest.raises(ValueError, match="drop the GradScaler"):
            scaler.step(opt)


def test_load_state_dict_inside_writes_the_fp32_masters_exactly():
    """A checkpoint loaded inside the manager reaches the fp32 masters as torch loads fp32 parameters, not rounded
    through the bf16 compute copies (the values below are not bf16-representable)."""
    torch.manual_seed(0)
    model = gpt()
    opt = adamw(model)
    torch.manual_seed(1)
    names = [n for n, _ in model.named_parameters()]
    target = {n: p.detach().clone() for n, p in gpt().named_parameters()}
    assert any(not torch.equal(v, v.to(BF16).float()) for v in target.values())
    with swap.SwapManager(budget="1GiB", device="cpu", model=model, optimizer=opt, model_state="offload",
                          bucket_bytes="32KiB", compute_dtype=BF16):  # fmt: skip
        x, y = batch(model, 0)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        model.load_state_dict(target, strict=False)
        inside = {n: array(v) for n, v in model.state_dict().items() if n in target}
        loss = loss_of(model, x, y)  # the compute copies were refreshed from the loaded masters
    after = dict(model.named_parameters())
    for n in names:
        assert inside[n].tobytes() == array(target[n]).tobytes(), n
        assert array(after[n]).tobytes() == array(target[n]).tobytes(), n
    torch.manual_seed(1)
    check = gpt().to(BF16)
    assert loss.item() == loss_of(check, x, y).item()


def offload(compute_dtype):
    def make(model, opt):
        return swap.SwapManager(budget="1GiB", device="cpu", model=model, optimizer=opt, model_state="offload",
                                bucket_bytes="32KiB", compute_dtype=compute_dtype)  # fmt: skip

    return make


def frozen_first_block():
    """A fine-tune with the first block frozen (its fp32 weights still streamed in bf16, with no gradient)."""
    model = gpt()
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    return model


def test_frozen_layers_are_bitwise_the_reference():
    got = run(build=frozen_first_block, manager=offload(BF16))
    assert_bitwise(run(build=frozen_first_block), got)
    assert sum(g is None for g in got["grads"]) == len(list(frozen_first_block().blocks[0].parameters()))


def test_fp16_compute_with_a_grad_scaler_is_bitwise_the_reference():
    """fp16 compute needs loss scaling; the scaler unscales and checks the fp32 host gradients."""
    assert_bitwise(run(torch.float16, scaler=True), run(torch.float16, manager=offload(torch.float16), scaler=True))
