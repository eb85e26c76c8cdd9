"""Every host<->device copy of a streamed bf16 micro-batch reads or writes page-locked host memory, as the pools
decide to pin on a CUDA run (no GPU here: a stand-in pinner records what would be registered): the weights' H2D
copies read the compute-dtype copies (Note [Mixed precision] in swap/runtime/model_state/precision.py), the
gradients' D2H copies land in the accumulation buffer, the activations' copies use the executor's host pool
(pinned on CUDA: ``open_resources`` in swap/runtime/machine/resources.py). The masters and the fp32 gradient
buffers, which no copy touches under mixed precision, are not pinned."""

import functools

import torch
from ms_training import gpt, train

import swap
from swap.runtime.machine import engines, resources
from swap.runtime.machine.host_pool import HostPool

MODEL = functools.partial(gpt, n_layer=2, d_model=64)


class Pinner:
    def __init__(self):
        self.ranges: list[tuple[int, int]] = []

    def pin(self, addr, nbytes):
        self.ranges.append((addr, addr + nbytes))

    def unpin(self, addr):
        pass

    def holds(self, t: torch.Tensor) -> bool:
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        return any(a <= lo and hi <= b for a, b in self.ranges)


@functools.cache
def budget():
    meter = swap.LiveBytesMeter("cpu")
    train(MODEL, meter=meter)
    return int(0.3 * meter.peak)


def test_every_copy_of_a_streamed_bf16_micro_batch_uses_pinned_host_memory(monkeypatch):
    pinner = Pinner()
    asked = []

    def pool(pinned, limit=None):  # open_resources' pool, pinned as on a CUDA run (``pinned=cuda``)
        asked.append(pinned)
        return HostPool(True, limit=limit, pinner=pinner)

    monkeypatch.setattr(resources, "HostPool", pool)
    copies = []  # (direction, the host operand) while the loop runs
    recording = [False]
    d2h, h2d = engines.HostEngine.d2h, engines.HostEngine.h2d

    def spy_d2h(self, dst, src, after=None):
        if recording[0]:
            copies.append(("d2h", dst))
        return d2h(self, dst, src, after)

    def spy_h2d(self, dst, src, after=None):
        if recording[0]:
            copies.append(("h2d", src))
        return h2d(self, dst, src, after)

    monkeypatch.setattr(engines.HostEngine, "d2h", spy_d2h)
    monkeypatch.setattr(engines.HostEngine, "h2d", spy_h2d)
    holder = {}

    def make(model, opt):
        policy = swap.ModelStatePolicy(placement="streamed", bucket_bytes="32KiB", compute_dtype=torch.bfloat16)
        sm = swap.SwapManager(budget=budget(), device="cpu", model=model, optimizer=opt, model_state=policy,
                              min_bytes="4KiB")  # fmt: skip
        sm.model_state.pinner = pinner
        holder["sm"] = sm
        return sm

    def start(*_):  # the manager has entered: the masters, buffers and first copies are made
        recording[0] = True

    def stop(step, *_):  # before the exit's one-time copies back (from the masters, synchronous)
        recording[0] = step < 2

    got = train(MODEL, "adamw", 3, 2, manager=make, inside=start, step_hook=stop)
    sm = got["manager"]
    assert asked == [False]  # on the CPU the executor's pool is asked for pageable memory: the decision is cuda's
    r = sm.report()
    assert r["swapped_out_bytes"] > 0  # activations did move
    ms = r["model_state"]
    assert ms["pinned_bytes"] == ms["pinned_bytes_predicted"] > 0
    kinds = {"h2d": 0, "d2h": 0}
    unpinned = [(d, t.data_ptr(), t.numel() * t.element_size()) for d, t in copies if not pinner.holds(t)]
    for d, _ in copies:
        kinds[d] += 1
    assert kinds["h2d"] > 0 and kinds["d2h"] > 0
    assert not unpinned, f"{len(unpinned)} of {len(copies)} copies use pageable host memory: {unpinned[:5]}"
