"""The host step's kernel and threads (Note [The host kernel], Note [Host threads] in
swap/runtime/model_state/host_optim.py): torch's fused CPU kernel where the user left torch's default, bitwise plain
training with that kernel; the user's own kernel, with a warning, where the user chose one; a thread budget of
the host's own that leaves the main thread's intra-op threads as they were."""

import threading
import warnings

import pytest
import torch
from ms_training import assert_bitwise, groups, same_bits, train

import swap
from swap.runtime.model_state import host_optim

STREAMED_64K = swap.ModelStatePolicy(placement="streamed", bucket_bytes="64KiB")


def offload(model, opt):
    return swap.SwapManager(budget="1GiB", device="cpu", policy="window", model=model, optimizer=opt,
                            model_state=STREAMED_64K)  # fmt: skip


def adamw(**flags):
    return lambda m: torch.optim.AdamW(groups(m), lr=3e-3, weight_decay=0.1, **flags)


def test_torchs_default_adamw_steps_on_the_host_with_the_fused_kernel():
    """The user's AdamW with torch's defaults: the offloaded run is bitwise plain training with fused=True (the
    user's param groups and state dicts keep fused=None), and not the per-tensor loop's bits."""
    got = train(optimizer=adamw(), manager=offload)
    fused = train(optimizer=adamw())  # plain: steps with fused=True, its param groups as made (ms_training)
    loop = train(optimizer=adamw(foreach=False))  # torch's default kernel on CPU tensors, by name
    assert_bitwise(fused, got)
    assert not all(same_bits(a, b) for a, b in zip(loop["params"], got["params"])), "the kernels must differ here"
    assert got["state"]["param_groups"][0]["fused"] is None
    r = got["manager"].report()["model_state"]
    assert r["host_kernel"] == "fused" and r["host_threads"] >= 1
    assert not any("kernel" in n for n in r["notes"])


@pytest.mark.parametrize(("flags", "kernel", "why"), [
    ({"foreach": False}, "for-loop", "AdamW was made with foreach=False"),
    ({"foreach": True}, "foreach", "AdamW was made with foreach=True"),
])  # fmt: skip
def test_a_kernel_chosen_by_name_runs_with_one_warning(flags, kernel, why):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train(optimizer=adamw(**flags), manager=offload)
    slow = [w for w in caught if issubclass(w.category, UserWarning) and "host step" in str(w.message)]
    assert len(slow) == 1, [str(w.message) for w in caught]
    assert f"runs the {kernel} kernel" in str(slow[0].message) and why in str(slow[0].message)
    assert "leave foreach= and fused= unset (or pass fused=True)" in str(slow[0].message)
    assert_bitwise(train(optimizer=adamw(**flags)), got)  # the user's kernel, as asked
    r = got["manager"].report()["model_state"]
    assert r["host_kernel"] == kernel and any(why in n for n in r["notes"])


def test_choose_names_what_the_fused_kernel_cannot_run():
    p = [torch.nn.Parameter(torch.ones(4))]
    assert host_optim.choose(torch.optim.SGD(p, lr=0.1), [{"foreach": None, "fused": None}]).overrides == {
        "fused": True}  # fmt: skip
    user = torch.optim.Adam(p, differentiable=True)
    k = host_optim.choose(user, user.param_groups)
    assert k.name == "for-loop" and "differentiable=True" in k.slow and k.overrides == {}
    rms = torch.optim.RMSprop(p)
    assert "RMSprop has no fused CPU kernel" in host_optim.choose(rms, rms.param_groups).slow
    fused = torch.optim.AdamW(p, fused=True)
    assert host_optim.choose(fused, fused.param_groups) == host_optim.HostKernel("fused")


def test_host_threads_leave_one_core_beside_a_device_and_the_compute_threads_on_cpu():
    assert host_optim.host_threads(torch.device("cuda"), available=16) == 15
    assert host_optim.host_threads(torch.device("cpu"), available=16, compute=4) == 12
    assert host_optim.host_threads(torch.device("cpu"), available=2, compute=2) == 1  # never none


def test_the_host_worker_has_its_threads_and_the_process_keeps_its_own(monkeypatch):
    """The worker's intra-op threads are the budget; the main thread's, and what a thread started later
    starts with (torch's process-wide count), stay as they were."""
    before = torch.get_num_threads()
    monkeypatch.setattr(host_optim, "cores", lambda: before + 3)
    worker, threads = host_optim.host_worker(torch.device("cuda"))
    try:
        assert threads == before + 2
        assert worker.submit(torch.get_num_threads).result() == threads
        assert torch.get_num_threads() == before
        seen = []
        later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        later.start()
        later.join()
        assert seen == [before]
    finally:
        worker.shutdown()
