"""bench/gpu/model_state_gpu.py's default budgets (Note [A budget the model enters within]): at least the model as
it enters the manager, still below its weights + AdamW state. On an H200 the 1B model in fp32 (4.40 GB) was given
4 GiB and every run's peak was above it before the first iteration; the 200M model's 1 GiB was below what its
training needs (1.20 GiB), so every run was refused once."""

import pytest

from bench.gpu import model_state_gpu as ms

GiB = 1 << 30


def budget(size: str, fp32_masters: bool) -> tuple[int, int, int]:
    """(budget, entry bytes, weights + AdamW state bytes), the model built on the meta device."""
    argv = ["--size", size, "--device", "meta"] + (["--fp32-masters"] if fp32_masters else [])
    cfg = ms.Config(ms.parser().parse_args(argv))
    model = cfg.build()
    state = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    return ms.budget_of(cfg, model), ms.entry_bytes(cfg, model), state


@pytest.mark.parametrize("size,fp32_masters,expected", [("1b", True, 4.5 * GiB), ("1b", False, 4 * GiB),
                                                        ("200m", True, 1.5 * GiB)])  # fmt: skip
def test_the_default_budget_holds_the_model_as_it_enters_and_is_below_its_state(size, fp32_masters, expected):
    b, entry, state = budget(size, fp32_masters)
    assert b == expected and entry < b < state, (b, entry, state)


def test_the_1b_entry_is_its_fp32_weights_and_the_embeddings_bf16_copy():
    _, entry, state = budget("1b", True)
    assert entry == state // 3 + 32000 * 2048 * 2 == 4_531_265_536


def test_a_budget_given_is_used_as_is():
    cfg = ms.Config(ms.parser().parse_args(["--size", "1b", "--device", "meta", "--fp32-masters", "--budget", "4GiB"]))
    assert ms.budget_of(cfg, cfg.build()) == 4 * GiB
