"""A model compiled whole with ``torch.compile`` and offloaded model state: refused at entry with the two ways that
run (Note [Model state and torch.compile]); before, an ``InfeasibleBudget`` came at any budget below the whole
model's state."""

import pytest
import torch
from ms_training import gpt

import swap

RESIDENT = swap.ModelStatePolicy(placement="resident")


@pytest.mark.parametrize("model_state", ["auto", "offload"])
def test_a_model_compiled_whole_is_refused_with_the_ways_that_run(model_state):
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="torch.compile") as e:
        swap.SwapManager(budget="1GiB", device="cpu", model=torch.compile(model), optimizer=opt,
                         model_state=model_state)  # fmt: skip
    assert "placement='resident'" in str(e.value) and "uncompiled" in str(e.value)
    # Kept on the device, the compiled model's state is torch's: the manager is built.
    swap.SwapManager(budget="1GiB", device="cpu", model=torch.compile(model), optimizer=opt, model_state=RESIDENT)
