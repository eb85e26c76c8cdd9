"""PyTorch Lightning: ``swap.integrations.lightning.SwapCallback`` (or ``with SwapManager(): trainer.fit``)."""

import pytest
import torch
from recipes import (
    MIN_BYTES,
    assert_bitwise_equal,
    assert_swapped_within,
    batch,
    budget_from_profile,
    gpt2,
    manager,
    params,
)

import swap

lightning = pytest.importorskip("lightning")
import swap.integrations.lightning as swap_lightning  # noqa: E402
from swap.integrations.lightning import SwapCallback  # noqa: E402


class LitGPT(lightning.LightningModule):
    def __init__(self, fail_at: int = -1) -> None:
        super().__init__()
        self.model = gpt2()
        self.losses: list[float] = []
        self.fail_at = fail_at

    def training_step(self, data, index):
        if index == self.fail_at:
            raise RuntimeError("boom")
        loss = self.model(**data).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader():
    data = batch(32, seed=0)
    rows = [{k: v[i] for k, v in data.items()} for i in range(32)]
    return torch.utils.data.DataLoader(rows, batch_size=8, shuffle=False)


def fit(callbacks, fail_at=-1):
    module = LitGPT(fail_at)
    trainer = lightning.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)  # fmt: skip
    trainer.fit(module, loader())
    return module.losses, params(module.model)


def test_callback_is_bitwise_equal_and_swaps():
    budget = budget_from_profile(lambda sm: fit([SwapCallback(manager=sm)]))
    ref_losses, ref_params = fit([])
    cb = SwapCallback(manager=manager(budget))
    losses, got = fit([cb])
    assert len(losses) == 4 and losses == ref_losses
    assert_bitwise_equal(ref_params, got)
    assert_swapped_within(cb.report, budget)
    assert cb.report["iterations"] == 4


def test_callback_builds_its_manager_at_train_start_on_the_modules_device(monkeypatch):
    built = []

    def recording(**kwargs):
        built.append(kwargs)
        return swap.SwapManager(**kwargs)

    monkeypatch.setattr(swap_lightning, "SwapManager", recording)
    cb = SwapCallback(budget="64GiB", min_bytes=MIN_BYTES)
    assert cb.manager is None and not built  # nothing is built before Lightning has placed the module
    fit([cb])
    assert built == [{"budget": "64GiB", "min_bytes": MIN_BYTES, "device": torch.device("cpu")}]
    assert cb.manager.device == torch.device("cpu") and not cb.manager._active
    assert cb.report["iterations"] == 4
    fit([cb])  # each fit gets a manager of its own
    assert len(built) == 2 and cb.report["iterations"] == 4


def test_callback_leaves_the_manager_when_training_fails():
    cb = SwapCallback(budget="64GiB", min_bytes=MIN_BYTES)
    with pytest.raises(RuntimeError, match="boom"):
        fit([cb], fail_at=2)
    assert cb.report is not None and cb.report["iterations"] == 2
    # The hooks are gone: a new manager can be entered, and plain autograd runs without one.
    with manager(1 << 30):
        pass
    x = torch.ones(3, requires_grad=True)
    (x * x).sum().backward()
    assert torch.equal(x.grad, 2 * torch.ones(3))
    with pytest.raises(ValueError, match="either a SwapManager or its keyword arguments"):
        SwapCallback(manager=manager(1 << 30), budget="1GiB")
    with pytest.raises(TypeError, match="SwapCallback takes swap.SwapManager's keyword arguments"):
        SwapCallback(budgett="1GiB")
