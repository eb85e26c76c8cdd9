"""``zero_grad(set_to_none=False)`` while speculative host steps are pending (Note [Speculative host steps] in
swap/runtime/model_state/speculation.py), issue 36's "possible deadlock", shown real: the zeroing queued on the
gradients' lane waits for the speculations reading those buffers, a speculation reads the gradients' signatures
under the gradient sink's lock, and the next backward waited for the lane (a staging buffer to free) holding that
lock. All three threads hung (Note [Waiting for the lane outside the lock] in
swap/runtime/model_state/gradients.py). The speculations are slowed down on purpose, and every backward
speculates, so that a speculation is still to run when the next backward needs the lane."""

import threading
import time

import torch
from ms_loops import assert_same, batch, loss_of, run
from ms_training import host_kernel
from test_ms_speculation import adamw, manager, small

from swap.runtime.model_state import host_step
from swap.runtime.model_state.speculation import SpeculationPolicy

ITERS = 3


def zero_between_backwards(model, opt, it, log):
    """Two backward passes over one forward (the graph retained), the first one's gradients thrown away by
    ``zero_grad(set_to_none=False)`` (the buffers kept as zeros) and the second's accumulated into them: the
    second pass reads no weight of the first layer (an embedding's backward needs only the indices), so nothing
    rolls that bucket's speculation back before the zeroing of its gradients waits for it."""
    opt.zero_grad()
    x, y = batch(it)
    loss = loss_of(model, x, y)
    loss.backward(retain_graph=True)
    opt.zero_grad(set_to_none=False)
    loss.backward()
    log["loss"].append(loss.item())
    opt.step()


def test_zero_grad_while_speculations_are_pending_does_not_deadlock(monkeypatch):
    ref = run(small, zero_between_backwards, iters=ITERS, make_opt=lambda m: host_kernel(adamw(m)))
    slow = host_step.HostStepper._speculate

    def late(self, *args, **kwargs):
        time.sleep(0.05)  # a busy host: the speculation reads its signatures late
        return slow(self, *args, **kwargs)

    monkeypatch.setattr(host_step.HostStepper, "_speculate", late)
    monkeypatch.setattr(SpeculationPolicy, "now", lambda self: self.enabled)  # every backward speculates
    out: dict = {}

    def managed():
        try:
            out["got"] = run(small, zero_between_backwards, iters=ITERS, make_opt=adamw, manager=manager)
        except BaseException as e:  # noqa: BLE001 -- raised below, on the test's thread
            out["error"] = e

    t = threading.Thread(target=managed, daemon=True)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "the loop hung: zero_grad's zeroing, a speculation and the backward wait on each other"
    if "error" in out:
        raise out["error"]
    got = out["got"]
    assert_same(ref, got)
    assert got["manager"].report()["model_state"]["speculation"]["speculated"] > 0
    assert torch.is_grad_enabled()
