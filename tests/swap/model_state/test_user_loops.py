"""The loops people write, as a test suite (issue 36, delivery item 2): tiny Hugging Face models (a decoder, an
encoder, an encoder-decoder, vision, MoE with experts that get no gradient, frozen layers, PEFT LoRA) each trained
in several of the usual loops (accumulation, clipping with a scheduler, bf16 autocast, fp16 with GradScaler,
checkpoints saved and resumed, a load inside the manager, ``zero_grad(set_to_none=False)``, skipped steps, eval
passes, a caught exception, the HF Trainer), under ``SwapManager(budget=, model=, optimizer=)`` with every other
setting its default. Each case: bitwise plain training of the same seed after N steps, at a budget halfway
between the weights' bytes and plain training's peak, every iteration within it by an independent meter that
re-reads every storage at each operator (Note [Sweeping every storage] in tests/swap/sweep_meter.py), the
profiling ones included (the README: "The first two iterations profile (within the budget)").

A case that fails because of a runtime defect is marked ``xfail(strict=True)`` with the defect, so that a fix
flips it and the marker has to go."""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch

pytest.importorskip("transformers")

from hf_loops import (  # noqa: E402 - after the skip
    Run,
    assert_same,
    build,
    checkpoint,
    inputs,
    load,
    run,
    within,
)
from sweep_meter import SweepMeter  # noqa: E402 - on the path hf_loops adds

import swap  # noqa: E402

N = 4  # optimizer steps a case runs
SPLIT = 2  # where a checkpoint is taken


def seeded(it: int) -> None:
    torch.manual_seed(10_000 + it)  # dropout's masks: the same for plain, managed and resumed runs


def plain_iteration(r: Run, it: int) -> None:
    r.opt.zero_grad()
    seeded(it)
    loss = r.loss(it)
    loss.backward()
    r.losses.append(loss.item())
    r.opt.step()
    r.end_iteration()


# -- the loops -----------------------------------------------------------------------------------------------------
def basic(r: Run, first: int = 0) -> None:
    for it in range(first, N):
        plain_iteration(r, it)


def accumulate(r: Run) -> None:
    """Two micro-batches a step, the loss divided by their number."""
    for it in range(N):
        r.opt.zero_grad()
        for micro in range(2):
            seeded(10 * it + micro)
            loss = r.loss(10 * it + micro)
            (loss / 2).backward()
            r.losses.append(loss.item())
        r.opt.step()
        r.end_iteration()


def clip_sched(r: Run) -> None:
    """torch's clipping (its norm logged) and a warm-up-then-decay LR scheduler."""
    sched = torch.optim.lr_scheduler.LambdaLR(r.opt, lambda s: min(1.0, (s + 1) / 2) * 0.8**s)
    for it in range(N):
        r.opt.zero_grad()
        seeded(it)
        loss = r.loss(it)
        loss.backward()
        r.losses.append(loss.item())
        r.losses.append(torch.nn.utils.clip_grad_norm_(r.model.parameters(), 0.5).item())
        r.opt.step()
        sched.step()
        r.end_iteration()


def bf16(r: Run) -> None:
    for it in range(N):
        r.opt.zero_grad()
        seeded(it)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = r.loss(it)
        loss.backward()
        r.losses.append(loss.item())
        r.opt.step()
        r.end_iteration()


def fp16_scaler(r: Run) -> None:
    """fp16 autocast with torch.amp.GradScaler: unscale, clip, scaler.step, update (its scale logged)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14)
    for it in range(N):
        r.opt.zero_grad()
        seeded(it)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = r.loss(it)
        scaler.scale(loss).backward()
        scaler.unscale_(r.opt)
        r.losses.append(torch.nn.utils.clip_grad_norm_(r.model.parameters(), 1.0).item())
        scaler.step(r.opt)
        scaler.update()
        r.losses += [loss.item(), scaler.get_scale()]
        r.end_iteration()


def zeros(r: Run) -> None:
    """``zero_grad(set_to_none=False)``: gradients kept as zeros between steps."""
    for it in range(N):
        r.opt.zero_grad(set_to_none=False)
        seeded(it)
        loss = r.loss(it)
        loss.backward()
        r.losses.append(loss.item())
        r.opt.step()
        r.end_iteration()


def skipped(r: Run) -> None:
    """The step after a loss spike is skipped: its gradients are dropped, no ``opt.step()``."""
    for it in range(N):
        r.opt.zero_grad()
        seeded(it)
        loss = r.loss(it)
        loss.backward()
        r.losses.append(loss.item())
        if it != 1:
            r.opt.step()
        r.end_iteration()


def evals(r: Run) -> None:
    """An eval pass (``model.eval()``, ``no_grad``) on a held-out batch after every step."""
    for it in range(N):
        plain_iteration(r, it)
        r.model.eval()
        with torch.no_grad():
            r.losses.append(r.loss(500 + it).item())
        r.model.train()
        r.end_iteration()


class BadBatch(Exception):
    pass


def exception(r: Run) -> None:
    """A forward fails halfway in the second iteration (a bad batch); the user catches it, drops the
    iteration's gradients and trains on."""
    layers = [m for name, m in r.model.named_modules() if name.endswith(("layers.0", "h.0", "block.0", "layer.0"))]

    def bad(module: Any, args: Any, out: Any) -> None:
        if state["fail"]:
            raise BadBatch

    state = {"fail": False}
    handle = layers[-1].register_forward_hook(bad)
    for it in range(N):
        state["fail"] = it == 1
        try:
            plain_iteration(r, it)
        except BadBatch:
            r.opt.zero_grad()
            r.losses.append(-1.0)
            r.end_iteration()
    handle.remove()


def save_resume(r: Run) -> None:
    """A checkpoint taken after step SPLIT (model and optimizer state dicts), training going on after it."""
    basic_to(r, SPLIT)
    r.blob = checkpoint(r.model, r.opt)
    basic(r, SPLIT)


def basic_to(r: Run, last: int) -> None:
    for it in range(last):
        plain_iteration(r, it)


@functools.cache
def plain_checkpoint(arch: str) -> bytes:
    r = run(arch, save_resume)
    return r.blob


def load_inside(r: Run) -> None:
    """A checkpoint of plain training's first SPLIT steps loaded inside the manager, then training on."""
    ck = load(plain_checkpoint(r.arch))
    r.model.load_state_dict(ck["model"])
    r.opt.load_state_dict(ck["opt"])
    del ck  # the loaded copies go, as they must where the model barely fits (on the CPU they count)
    if r.meter is not None:
        r.meter.reset_window()  # the checkpoint read in whole is the user's memory, not an iteration's
    basic(r, SPLIT)


def trainer(r: Run) -> None:
    """The HF Trainer over a tiny dataset with the user's optimizer (its linear scheduler and clipping)."""
    import tempfile

    import transformers

    data = [{k: v[0] for k, v in inputs(r.arch, i, n=1).items()} for i in range(2 * N)]

    class Iterations(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            r.end_iteration()

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=N,
                                              learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no",
                                              logging_steps=1, seed=0, dataloader_num_workers=0,
                                              disable_tqdm=True)  # fmt: skip
        t = transformers.Trainer(model=r.model, args=args, train_dataset=data, optimizers=(r.opt, None),
                                 callbacks=[Iterations()])  # fmt: skip
        t.train()
    r.losses += [h["loss"] for h in t.state.log_history if "loss" in h]


LOOPS: dict[str, Callable[[Run], None]] = {
    "accumulate": accumulate, "clip_sched": clip_sched, "bf16": bf16, "fp16_scaler": fp16_scaler,
    "zeros": zeros, "skipped": skipped, "evals": evals, "exception": exception, "save_resume": save_resume,
    "load_inside": load_inside, "trainer": trainer,
}  # fmt: skip

# Each loop on 2-3 architectures, each architecture in >= 3 loops.
CASES: list[tuple[str, str]] = [
    ("gpt2", "accumulate"), ("gpt2", "exception"), ("gpt2", "trainer"),
    ("llama", "clip_sched"), ("llama", "bf16"), ("llama", "load_inside"), ("llama", "skipped"),
    ("bert", "fp16_scaler"), ("bert", "zeros"), ("bert", "trainer"),
    ("t5", "clip_sched"), ("t5", "save_resume"), ("t5", "exception"),
    ("vit", "bf16"), ("vit", "zeros"), ("vit", "evals"),
    ("switch", "accumulate"), ("switch", "skipped"), ("switch", "evals"),
    ("llama_frozen", "clip_sched"), ("llama_frozen", "fp16_scaler"), ("llama_frozen", "load_inside"),
    ("llama_frozen", "save_resume"),
    ("lora", "bf16"), ("lora", "save_resume"), ("lora", "evals"),
]  # fmt: skip

# Cases that fail today, each with the runtime defect it shows (strict: a fix makes them fail until removed).
# None now: t5-clip_sched, gpt2-trainer and llama-clip_sched went over only by counting the host gradient buffers
# that clipping reads (Note [Host operators unseen]); switch-evals was refused by a profile that counted every
# bucket its eval pass dropped as held (Note [A held tensor freed mid-step]). tests/swap/model_state/
# test_ms_loop_budget.py shows both on a small GPT.
XFAIL: dict[tuple[str, str], tuple[str, type]] = {}
# Cases that failed in one order and passed in another (not strict: either outcome passes, the report shows which).
UNSTEADY: dict[tuple[str, str], str] = {}


def weight_bytes(arch: str) -> int:
    model, _ = build(arch)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@functools.cache
def plain(arch: str, loop: str) -> tuple[Run, int]:
    """Plain training's run and the case's budget: halfway between the weights' bytes and its peak."""
    meter = swap.LiveBytesMeter("cpu")
    ref = run(arch, LOOPS[loop], meter=meter)
    return ref, (weight_bytes(arch) + max(ref.peaks)) // 2


def params(cases: list[tuple[str, str]]) -> list[Any]:
    out = []
    for case in cases:
        marks = []
        if case in XFAIL:  # the failure the defect gives, and no other
            reason, raises = XFAIL[case]
            marks = [pytest.mark.xfail(strict=True, raises=raises, reason=reason)]
        elif case in UNSTEADY:
            marks = [pytest.mark.xfail(strict=False, raises=AssertionError, reason=UNSTEADY[case])]
        out.append(pytest.param(*case, marks=marks, id="-".join(case)))
    return out


@pytest.mark.parametrize("arch, loop", params(CASES))
def test_loop_trains_bitwise_within_the_budget(arch: str, loop: str) -> None:
    if arch == "lora":
        pytest.importorskip("peft")
    ref, budget = plain(arch, loop)
    assert budget < max(ref.peaks)
    if arch == "switch":  # the premise: experts no token reached have no gradient, and so no AdamW state
        assert any(ref.grads_none) and len(ref.state) < len(ref.params)
    got = run(arch, LOOPS[loop], budget=budget, meter=SweepMeter("cpu"))
    assert_same(ref, got)
    within(got, budget)
    if loop == "save_resume":  # the checkpoint saved under the manager is plain torch's, and resumes plainly
        resumed = run(arch, functools.partial(resume, blob=got.blob))
        assert_same(ref, resumed, losses=False)


def resume(r: Run, blob: bytes) -> None:
    ck = load(blob)
    r.model.load_state_dict(ck["model"])
    r.opt.load_state_dict(ck["opt"])
    del ck
    basic(r, SPLIT)


def test_plain_resume_is_the_reference() -> None:
    """The save / resume cases' reference holds: plain torch resumed from its own checkpoint is bitwise plain
    training (the dropout masks are seeded by iteration)."""
    full = run("gpt2", basic)
    again = run("gpt2", functools.partial(resume, blob=plain_checkpoint("gpt2")))
    assert_same(full, again, losses=False)
