"""The model-state recipes for trainers (docs/model_state.md, "With your trainer"; issue 36, delivery item 7): each
Python block of that section runs here as written, given a small GPT-2 (``gpt2`` below), its data and a budget,
and trains four steps on CPU under ``SwapManager(budget=, model=, optimizer=)`` with every other setting its
default. Each is bitwise equal to the same code without the manager, with the model state offloaded (the report's
placements name streamed or host-master buckets) and the report's peak within the budget.

The references step with the kernel the host step runs where the user left torch's default, fused (Note [The host
kernel] in swap/runtime/model_state/host_optim.py); the Trainer's own optimizer is fused already
(``args.optim="adamw_torch_fused"``)."""

from __future__ import annotations

import gc
import re
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from recipes import SEQ, assert_bitwise_equal, batch, params

import swap

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

DOC = Path(__file__).resolve().parents[2] / "docs" / "model_state.md"
STEPS, BATCH = 4, 2


def gpt2() -> torch.nn.Module:
    """A GPT-2 whose model state (2.6 MB of weights, 10.5 MB with their gradients and AdamW state) is most of plain
    training's 16 MB peak at this batch; its saved activations are each under the manager's default min_bytes
    (1 MiB), so they stay on the device and the budget is met by offloading the model state."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=SEQ, vocab_size=2048)
    return transformers.GPT2LMHeadModel(cfg)


def recipes() -> list[str]:
    """The Python blocks of docs/model_state.md's "With your trainer" section, in order."""
    section = DOC.read_text().split("\n## With your trainer\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)


def run_recipe(code: str, **names: Any) -> dict[str, Any]:
    """Runs a recipe as written, its free names (``model``, ``args``, ...) given; returns its namespace."""
    namespace = dict(names)
    exec(compile(code, f"{DOC} (With your trainer)", "exec"), namespace)
    return namespace


class Samples(torch.utils.data.Dataset):
    """``STEPS * BATCH`` rows of one batch: the same samples, in the same order (no shuffling), for every run."""

    def __init__(self) -> None:
        data = batch(STEPS * BATCH, seed=0)
        self.rows = [{k: v[i] for k, v in data.items()} for i in range(STEPS * BATCH)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def trainer_args(out: Path) -> Any:
    return transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-3,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip


def loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(Samples(), batch_size=BATCH, shuffle=False)


def fused(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt`` stepping with torch's fused CPU kernel, its groups keeping the user's flags outside ``step()``:
    plain training with the host step's kernel (as tests/swap/model_state/ms_training.py's ``host_kernel``)."""
    assert all(g.get("fused") is None and g.get("foreach") is None for g in opt.param_groups)

    def flag(value: Optional[bool]) -> Callable[..., None]:
        def hook(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            for g in o.param_groups:
                g["fused"] = value

        return hook

    opt.register_step_pre_hook(flag(True))
    opt.register_step_post_hook(flag(None))
    return opt


def measured(train: Callable[[], Any]) -> tuple[Any, int]:
    """``train()``'s result and a budget 60 % of the way from the live CPU bytes before it to its peak (everything
    it makes: weights, gradients, AdamW state, activations), so that the model state cannot all stay resident
    (at 50 % the embedding's backward does not fit beside the activations kept under min_bytes)."""
    gc.collect()
    with swap.LiveBytesMeter("cpu") as meter:
        meter.track_existing()
        start = meter.live
        result = train()
    return result, start + (meter.peak - start) * 6 // 10


def trainer_losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def assert_offloaded_within(sm: swap.SwapManager, budget: int) -> None:
    report = sm.report()
    placements = report["model_state"]["placements"]
    assert placements.get("streamed", 0) + placements.get("host_master", 0) > 0, placements
    assert report["peak_device_bytes"] <= budget, (report["peak_device_bytes"], budget)


def test_the_section_has_the_three_recipes():
    blocks = recipes()
    assert len(blocks) == 3
    assert "optimizers=(opt, None)" in blocks[0] and "trainer.create_optimizer()" in blocks[1]
    assert "accelerator.prepare(model, opt, loader)" in blocks[2]
    assert all("swap.SwapManager(budget=budget, model=model, optimizer=opt)" in b for b in blocks)


def test_trainer_with_your_optimizer(tmp_path):
    def plain() -> tuple[list[float], list[Any]]:
        model, args = gpt2(), trainer_args(tmp_path / "plain")
        opt = fused(torch.optim.AdamW(model.parameters(), lr=args.learning_rate))
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Samples(), optimizers=(opt, None))
        trainer.train()
        return trainer_losses(trainer), params(model)

    (ref_losses, ref_params), budget = measured(plain)
    ns = run_recipe(recipes()[0], model=gpt2(), args=trainer_args(tmp_path / "swap"), train_dataset=Samples(),
                    budget=budget)  # fmt: skip
    losses = trainer_losses(ns["trainer"])
    assert len(losses) == STEPS and losses == ref_losses
    assert_bitwise_equal(ref_params, params(ns["model"]))
    assert_offloaded_within(ns["sm"], budget)


def test_trainer_with_its_own_optimizer_built_ahead(tmp_path):
    def plain() -> tuple[list[float], list[Any]]:
        model = gpt2()
        trainer = transformers.Trainer(model=model, args=trainer_args(tmp_path / "plain"), train_dataset=Samples())
        trainer.train()
        assert type(trainer.optimizer.optimizer) is torch.optim.AdamW  # args.optim's default, made in train()
        assert all(g["fused"] for g in trainer.optimizer.param_groups)
        return trainer_losses(trainer), params(model)

    (ref_losses, ref_params), budget = measured(plain)
    ns = run_recipe(recipes()[1], model=gpt2(), args=trainer_args(tmp_path / "swap"), train_dataset=Samples(),
                    budget=budget)  # fmt: skip
    assert ns["trainer"].optimizer.optimizer is ns["opt"]  # train() used the optimizer built ahead
    losses = trainer_losses(ns["trainer"])
    assert len(losses) == STEPS and losses == ref_losses
    assert_bitwise_equal(ref_params, params(ns["model"]))
    assert_offloaded_within(ns["sm"], budget)


@pytest.mark.parametrize("given", ["prepared", "unwrapped"])
def test_accelerate(given):
    # Before Note [Optimizer wrappers] the prepared optimizer was refused at entry: "AcceleratedOptimizer is not
    # supported for offloaded model state". Its .optimizer (the user's AdamW) trained.
    def plain() -> tuple[list[float], list[Any]]:
        accelerator = accelerate.Accelerator()
        model = gpt2()
        opt = fused(torch.optim.AdamW(model.parameters(), lr=1e-3))
        model, opt, data = accelerator.prepare(model, opt, loader())
        losses = []
        for b in data:
            loss = model(**b).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, params(model)

    (ref_losses, ref_params), budget = measured(plain)
    code = recipes()[2]
    if given == "unwrapped":
        code = code.replace("optimizer=opt)", "optimizer=opt.optimizer)")
        assert "optimizer=opt.optimizer)" in code
    model = gpt2()
    ns = run_recipe(code, model=model, loader=loader(), budget=budget)
    assert type(ns["opt"]).__name__ == "AcceleratedOptimizer" and ns["model"] is model  # one process: no DDP
    assert_bitwise_equal(ref_params, params(model))
    assert_offloaded_within(ns["sm"], budget)
    assert ns["loss"].item() == ref_losses[-1]


def test_a_wrapped_optimizer_the_host_cannot_step_is_refused_by_its_own_name():
    model = gpt2()
    wrapped = accelerate.Accelerator().prepare(torch.optim.Adagrad(model.parameters()))
    with pytest.raises(ValueError, match="^Adagrad is not supported for offloaded model state"):
        swap.SwapManager(budget="1GiB", device="cpu", model=model, optimizer=wrapped)
