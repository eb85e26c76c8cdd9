"""The Hugging Face ``Trainer`` recipe: ``with swap.SwapManager(...): trainer.train()``."""

import contextlib

import pytest
import torch
from recipes import assert_bitwise_equal, assert_swapped_within, batch, budget_from_profile, gpt2, manager, params

transformers = pytest.importorskip("transformers")


class Samples(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        data = batch(n, seed=0)
        self.rows = [{k: v[i] for k, v in data.items()} for i in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def train(tmp_path, sm=None):
    model = gpt2()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=8, learning_rate=1e-3, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Samples())
    with sm if sm is not None else contextlib.nullcontext():
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, params(model)


def test_trainer_is_bitwise_equal_and_swaps(tmp_path):
    budget = budget_from_profile(lambda sm: train(tmp_path / "probe", sm))
    ref_losses, ref_params = train(tmp_path / "ref")
    sm = manager(budget)
    losses, got = train(tmp_path / "swap", sm)
    assert len(losses) == 4 and losses == ref_losses
    assert_bitwise_equal(ref_params, got)  # four optimizer steps from identical gradients
    report = sm.report()
    assert_swapped_within(report, budget)
    assert report["iterations"] == 4
