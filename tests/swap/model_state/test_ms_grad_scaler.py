"""fp16 autocast with ``torch.amp.GradScaler`` (Note [Unscaling host gradients]): ``unscale_`` and ``step`` see
the gradients kept on the host, check them for inf and skip the steps plain training skips, bitwise plain torch,
with every bucket streamed and with some resident."""

import functools

import torch
from ms_loops import assert_same, batch, gpt, loss_of, run

import swap

STREAMED = swap.ModelStatePolicy(placement="streamed")


class ScaledLoop:
    """The AMP recipe: autocast fp16, ``scale(loss).backward()``, ``unscale_``, clip, ``step``, ``update``. The
    first scale overflows fp16, so the first steps are skipped until the scale has backed off."""

    def __init__(self) -> None:
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2)

    def __call__(self, model, opt, it, log):
        opt.zero_grad()
        x, y = batch(it)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(model, x, y)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(opt)
        log["norm"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        self.scaler.step(opt)
        self.scaler.update()
        log["loss"].append(loss.item())
        log["scale"].append(self.scaler.get_scale())


def loop():
    s = ScaledLoop()

    def step(model, opt, it, log):
        log.setdefault("norm", [])
        log.setdefault("scale", [])
        s(model, opt, it, log)

    return step


@functools.cache
def plain():
    meter = swap.LiveBytesMeter("cpu")
    return run(gpt, loop(), iters=8, meter=meter), meter.peak


def manager(budget="64MiB", **kw):
    def make(model, opt):
        return swap.SwapManager(budget=budget, device="cpu", model=model, optimizer=opt, bucket_bytes="64KiB",
                                min_bytes="4KiB", **kw)  # fmt: skip

    return make


def test_grad_scaler_unscales_and_checks_host_gradients():
    ref, _ = plain()
    scales = ref["log"]["scale"]
    skipped = [b < a for a, b in zip([2.0**20] + scales, scales)]
    assert any(skipped) and not all(skipped), f"the run must skip steps, and step: scales {scales}"
    got = run(gpt, loop(), iters=8, manager=manager(model_state=STREAMED))
    assert_same(ref, got)
    assert list(got["manager"].report()["model_state"]["placements"]) == ["streamed"]


def test_grad_scaler_with_some_buckets_resident():
    ref, peak = plain()
    got = run(gpt, loop(), iters=8, manager=manager(int(0.8 * peak)))
    assert_same(ref, got)
    placements = got["manager"].report()["model_state"]["placements"]
    assert placements.get("resident") and len(placements) > 1, placements
