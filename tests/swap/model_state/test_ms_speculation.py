"""Speculative host steps (Note [Speculative host steps] in swap/runtime/model_state/speculation.py): each
offloaded bucket's update starts during the backward and is kept when ``opt.step()`` confirms its inputs, rolled
back exactly and redone otherwise. Every way a step can differ from the speculation, each in its own loop, is
bitwise plain training on CPU with the default optimizer (the host's fused kernel: Note [One kernel on a CPU
run]), and each test checks that the case really speculated, and kept or rolled back as it should."""

from __future__ import annotations

import functools
import gc
from typing import Any, Callable

import pytest
import torch
from ms_loops import assert_same, batch, loss_of, run
from ms_training import host_kernel

import swap
from swap.forecast import zoo
from swap.runtime.model_state.speculation import SpeculationPolicy

ITERS = 5


def small() -> torch.nn.Module:
    return zoo.gpt(n_layer=1, n_head=2, d_model=32, vocab=256, seq_len=32)


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The user's default AdamW (torch's default kernel; the host step runs the fused one)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=3e-3, weight_decay=0.1)


def manager(model, opt, **kw):
    return swap.SwapManager(budget="1GiB", device="cpu", policy="window", model=model, optimizer=opt,
                            model_state="offload", bucket_bytes="16KiB", **kw)  # fmt: skip


Step = Callable[[torch.nn.Module, torch.optim.Optimizer, int, dict], None]


@functools.cache
def _plain(name: str) -> dict[str, Any]:
    return run(small, LOOPS[name](), iters=ITERS, make_opt=lambda m: host_kernel(adamw(m)))


def check(name: str, **kw: Any) -> dict[str, Any]:
    """The loop ``name`` under the manager, bitwise its plain run; returns the report's speculation counts."""
    got = run(small, LOOPS[name](), iters=ITERS, make_opt=adamw, manager=lambda m, o: manager(m, o, **kw))
    assert_same(_plain(name), got)
    ms = got["manager"].report()["model_state"]
    spec = ms["speculation"]
    assert spec["speculated"] == spec["kept"] + spec["rolled_back"]  # each one kept or undone, none left over
    return {**spec, "buckets": ms["buckets"], "steps": ms["steps"]}


# -- the loops ---------------------------------------------------------------------------------------------------
def forward_backward(model, it, scale=1.0):
    x, y = batch(it)
    loss = loss_of(model, x, y)
    (loss * scale).backward()
    return loss


def plain_loop() -> Step:
    def step(model, opt, it, log):
        opt.zero_grad()
        log["loss"].append(forward_backward(model, it).item())
        opt.step()

    return step


def clip_loop(max_norm: float) -> Callable[[], Step]:
    def make() -> Step:
        def step(model, opt, it, log):
            opt.zero_grad()
            log["loss"].append(forward_backward(model, it).item())
            log.setdefault("norm", []).append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
            opt.step()

        return step

    return make


def accumulation_loop() -> Step:
    def step(model, opt, it, log):
        opt.zero_grad()
        for micro in range(3):
            log["loss"].append(forward_backward(model, it * 10 + micro, 1 / 3).item())
        opt.step()

    return step


def scaler_loop() -> Step:
    """fp16 autocast with GradScaler: unscale_, clip, step (skipped on an inf: the first scale overflows), update."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2)

    def step(model, opt, it, log):
        opt.zero_grad()
        x, y = batch(it)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(model, x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        log.setdefault("norm", []).append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        scaler.step(opt)
        scaler.update()
        log["loss"].append(loss.item())
        log.setdefault("scale", []).append(scaler.get_scale())

    return step


def skip_loop() -> Step:
    """Every third iteration's step is skipped (a loss spike guard, say): zero_grad without opt.step()."""

    def step(model, opt, it, log):
        opt.zero_grad()
        log["loss"].append(forward_backward(model, it).item())
        if it % 3 != 1:
            opt.step()

    return step


def discard_loop() -> Step:
    """A backward whose gradients are thrown away (zero_grad) before the backward that is stepped."""

    def step(model, opt, it, log):
        opt.zero_grad()
        forward_backward(model, 1000 + it)
        opt.zero_grad(set_to_none=it % 2 == 0)
        log["loss"].append(forward_backward(model, it).item())
        opt.step()

    return step


def hyper_loop(what: str) -> Callable[[], Step]:
    """The hyperparameters change between the backward and the step: a learning rate written by hand (warm-up
    after the backward), a scheduler stepped before the optimizer, a param group's weight decay edited."""

    def make() -> Step:
        sched: list[Any] = []

        def step(model, opt, it, log):
            opt.zero_grad()
            log["loss"].append(forward_backward(model, it).item())
            if what == "lr":
                for g in opt.param_groups:
                    g["lr"] = 3e-3 * (it + 1) / ITERS
            elif what == "sched":
                if not sched:
                    sched.append(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
                sched[0].step()
            else:
                opt.param_groups[0]["weight_decay"] = 0.1 + 0.05 * it
            opt.step()

        return step

    return make


def grad_reads_loop() -> Step:
    """The loop reads p.grad between backward and step (a norm for logging) and writes one through ``.data``,
    which no version counter sees."""

    def step(model, opt, it, log):
        opt.zero_grad()
        log["loss"].append(forward_backward(model, it).item())
        log.setdefault("norm", []).append(sum(float(p.grad.norm()) for p in model.parameters()))
        if it % 2:
            model.head.weight.grad.data.mul_(0.5)
        opt.step()

    return step


def checkpoint_loop() -> Step:
    """State dicts taken between backward and step (a checkpoint at a bad moment). What it logs are NumPy copies:
    ``t.clone().numpy()`` shares the clone's memory, a CPU tensor that the cached plain run (``_plain``) kept alive
    for the rest of the session, and the CPU budget of every later test counts it (Note [What the CPU budget
    counts]): 300 KB, which refused test_ms_frozen's LoRA run and the first of test_ms_entry_budget run after it."""

    def step(model, opt, it, log):
        opt.zero_grad()
        log["loss"].append(forward_backward(model, it).item())
        log.setdefault("weights", []).append(model.state_dict()["head.weight"].numpy().copy())
        exp_avg = opt.state_dict()["state"].get(0, {}).get("exp_avg")
        log.setdefault("exp_avg", []).append(None if exp_avg is None else exp_avg.numpy().copy())
        opt.step()

    return step


def state_dict_write_loop(how: str) -> Callable[[], Step]:
    """The user writes a weight between the backward and the step, through the model's state dict: ``held``, in
    place into a state dict taken before the backward (its tensors are the weights themselves, as torch's are);
    ``load``, by loading an edited copy."""

    def make() -> Step:
        held: list[dict[str, torch.Tensor]] = []

        def step(model, opt, it, log):
            opt.zero_grad()
            if how == "held" and not held:  # the rest of the state dict let go: its buckets still speculate
                kept = ("head.weight", "blocks.0.ln1.weight")
                held.append({k: v for k, v in model.state_dict().items() if k in kept})
            log["loss"].append(forward_backward(model, it).item())
            with torch.no_grad():
                if how == "held":
                    held[0]["head.weight"].mul_(0.5)
                    held[0]["blocks.0.ln1.weight"].add_(0.25)
                else:
                    sd = {k: v.clone() for k, v in model.state_dict().items()}
                    sd["head.weight"].mul_(0.5)
                    model.load_state_dict(sd)
            opt.step()
            log.setdefault("weights", []).append(model.state_dict()["head.weight"].numpy().copy())

        return step

    return make


LOOPS: dict[str, Callable[[], Step]] = {
    "plain": plain_loop,
    "clip_loose": clip_loop(1e6),
    "clip_binding": clip_loop(1e-3),
    "accumulation": accumulation_loop,
    "grad_scaler": scaler_loop,
    "skipped_step": skip_loop,
    "discarded_backward": discard_loop,
    "lr_after_backward": hyper_loop("lr"),
    "sched_before_step": hyper_loop("sched"),
    "group_edited": hyper_loop("weight_decay"),
    "grad_reads": grad_reads_loop,
    "checkpoint": checkpoint_loop,
    "held_state_dict_write": state_dict_write_loop("held"),
    "load_state_dict": state_dict_write_loop("load"),
}


# -- the tests ---------------------------------------------------------------------------------------------------
def test_plain_loop_keeps_every_speculation():
    spec = check("plain")
    # From the second backward on (the first re-packs the buckets), every bucket is speculated and kept.
    assert spec["kept"] >= (ITERS - 1) * spec["buckets"] and spec["rolled_back"] == 0
    # The rollback copies: every bucket's master and AdamW state at once, as predicted to the byte.
    assert spec["rollback_bytes_peak"] == spec["rollback_bytes_predicted"] > 0


def test_clip_that_does_not_bind_keeps_the_speculation():
    """Clipping whose coefficient is 1 writes no gradient: the speculation stands."""
    spec = check("clip_loose")
    assert spec["kept"] >= (ITERS - 1) * spec["buckets"] and spec["rolled_back"] == 0


@pytest.mark.parametrize("name", ["clip_binding", "grad_scaler", "skipped_step", "discarded_backward",
                                  "lr_after_backward", "sched_before_step", "group_edited", "grad_reads",
                                  "checkpoint"])  # fmt: skip
def test_step_unlike_the_speculation_is_rolled_back_exactly(name):
    spec = check(name)
    assert spec["rolled_back"] > 0


def test_accumulation_speculates_on_the_last_micro_batch():
    """The first step's speculation (after its first micro-batch) is undone by the second; from then on only the
    last micro-batch of three speculates, and it is kept."""
    spec = check("accumulation")
    assert spec["rolled_back"] > 0 and spec["kept"] >= (ITERS - 2) * spec["buckets"]


def test_speculation_off_where_its_copies_do_not_fit():
    model = small()
    opt = adamw(model)
    probe = manager(model, opt)
    pred = probe.model_state.prediction
    sm = manager(model, opt, host_memory=pred.total + pred.rollback - 1)
    assert not sm.model_state.speculate
    with sm:
        for it in range(2):
            opt.zero_grad()
            forward_backward(model, it)
            opt.step()
    ms = sm.report()["model_state"]
    assert ms["speculation"]["speculated"] == 0 and not ms["speculation"]["on"]
    assert any("rollback copies" in n for n in ms["notes"])


def test_policy_learns_accumulation_and_backs_off():
    p = SpeculationPolicy()
    assert p.now()  # the first backward speculates
    for _ in range(3):  # a step of three backward passes
        p.backward_ended()
    p.stepped()
    seen = []
    for _ in range(3):
        seen.append(p.now())
        p.backward_ended()
    assert seen == [False, False, True]  # only the last micro-batch
    p.stepped()
    p.failed(2)  # a failed step pauses one step, then two, four, ... at most MAX_PAUSE
    p.failed(2)  # (once a step, however many buckets failed)
    assert p.pause == 1 and not p.now()
    p.stepped()
    assert p.now()
    p.failed(3)
    assert p.pause == 2
    for n in range(4, 20):
        p.failed(n)
    assert p.pause == SpeculationPolicy.MAX_PAUSE
    p.kept()
    assert p.failures == 0


@pytest.mark.parametrize("name", ["held_state_dict_write", "load_state_dict"])
def test_a_write_through_the_state_dict_before_the_step_is_kept(name):
    """A weight the user writes between the backward and ``opt.step()``, through the state dict, is the weight the
    step updates, as in plain torch: a speculation made before the write is not kept over it, nor does its
    rollback undo it (Note [Masters handed out])."""
    spec = check(name)
    assert spec["speculated"] > 0


@pytest.mark.parametrize("name", ["checkpoint", "held_state_dict_write"])
def test_a_kept_plain_run_holds_no_tensor(name):
    """``_plain`` keeps each loop's plain run for the session: what it logs must hold no CPU tensor memory, which
    every later test's CPU budget would count (Note [What the CPU budget counts] in swap.runtime.machine.memory)."""
    gc.collect()
    before = swap.LiveBytesMeter("cpu").track_existing().live
    kept = _plain.__wrapped__(name)
    gc.collect()
    assert swap.LiveBytesMeter("cpu").track_existing().live == before, "the run's log holds tensor memory"
    assert kept["log"]["weights"]
