"""``python -m swap.plan`` on the questions people ask of model state (issue 35 item 7): a model whose state
outgrows the device is planned with its state offloaded (on a named default host profile) and exits 0, not
"none fits"; a small model's forecast says why offload does not fit instead of failing on an assert; and
``--min-bytes 0`` is taken, as ``SwapManager(min_bytes=0)`` is."""

import pytest
import torch

import swap
from swap.cli import NOTHING_FITS, main
from swap.forecast.zoo import llama

WIDE_FILE = '''
import torch
from torch import nn

def model_fn():  # 33.6 M parameters: 134 MiB of fp32 weights, 537 MiB with gradients and AdamW's state
    return nn.Sequential(*(m for _ in range(8) for m in (nn.Linear(2048, 2048), nn.ReLU())), nn.Linear(2048, 10))

def batch_fn(n):
    return torch.randn(n, 2048), torch.randint(0, 10, (n,))
'''

MLP_FILE = '''
import torch
from torch import nn

def model_fn():  # 4 MiB of parameters: one bucket
    return nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(512, 512), nn.ReLU())), nn.Linear(512, 10))

def batch_fn(n):
    return torch.randn(n, 512), torch.randint(0, 10, (n,))
'''


def run(tmp_path, source, *argv):
    f = tmp_path / "m.py"
    f.write_text(source)
    return main(["--model", str(f), "--batch", str(f), "--quiet", "--strategies", "off", *argv])


def test_a_model_whose_state_outgrows_the_budget_is_planned_with_it_offloaded(tmp_path, capsys):
    # "Will this full AdamW fine-tune fit?" printed "none fits ... choose a device with more" and exited 1, without
    # a word of model-state offload unless --host was given.
    rc = run(tmp_path, WIDE_FILE, "--budget", "300MiB", "--device", "rtx4090", "--policies", "none,window",
             "--optimizer", "adamw")  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "no batch fits with model state (parameters, gradients, optimizer state) on the device, but batch 1 fits " \
           "with model state offloaded to the host" in out
    assert "on host profile desktop-ddr5-2ch (the default for this device; host= or --host to choose another" in out
    assert "model state under the budget" in out and "ours (the runtime)" in out
    assert "choose a device with more" not in err


ONE_WEIGHT_FILE = MLP_FILE.replace("model_fn():  # 4 MiB of parameters: one bucket", "model_fn():  # a 16 MiB weight")
ONE_WEIGHT_FILE = ONE_WEIGHT_FILE.replace(
    "nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(512, 512), nn.ReLU())), nn.Linear(512, 10))",
    "nn.Sequential(nn.Linear(512, 8192), nn.ReLU(), nn.Linear(8192, 10))")  # fmt: skip


def test_a_small_model_says_why_offload_does_not_fit(tmp_path, capsys):
    # It died with a bare AssertionError in swap/forecast/offload.py when no room held a plan. A parameter is never
    # split, so a 16 MiB weight is a bucket no room of a 16 MiB budget holds in flight, whatever the bucket size.
    assert "a 16 MiB weight" in ONE_WEIGHT_FILE and "8192" in ONE_WEIGHT_FILE
    rc = run(tmp_path, ONE_WEIGHT_FILE, "--budget", "16MiB", "--device", "rtx4090", "--policies", "none",
             "--host", "desktop-ddr5-2ch", "--at-batch", "512")  # fmt: skip
    out, err = capsys.readouterr()
    assert rc in (0, NOTHING_FITS) and "Traceback" not in err
    line = next(x for x in out.splitlines() if x.startswith("ours (the runtime)"))
    assert "does not fit" in line and "even with every bucket streamed" in line and "raise the budget by" in line


def test_min_bytes_0_is_taken_as_the_manager_takes_it(tmp_path, capsys):
    # "--min-bytes 0" was refused ("min_bytes must be at least 1 byte") though SwapManager(min_bytes=0) is not.
    assert swap.SwapManager(budget="1GiB", min_bytes=0, device="cpu").min_bytes == 0
    assert run(tmp_path, MLP_FILE, "--budget", "64MiB", "--policies", "none", "--min-bytes", "0",
               "--max-batch", "4") == 0  # fmt: skip
    assert "none" in capsys.readouterr().out

    def tiny():
        return llama(2, 64, 4, 2, 128, 256)

    def tiny_batch(n):
        tokens = torch.randint(0, 256, (n, 33))
        return {"idx": tokens[:, :-1], "labels": tokens[:, 1:]}

    for zero in (0, "0", "0MiB"):  # read before anything is captured: the host profile is refused after it
        with pytest.raises(ValueError, match="unknown host profile 'laptop'"):
            swap.plan(tiny, tiny_batch, budget="1GiB", min_bytes=zero, host="laptop", batch=1, progress=False)


def test_compute_dtype_is_forecast_as_the_runtime_trains_it(tmp_path, capsys):
    # issue 37: the forecast refused compute_dtype; --compute-dtype now prices the runtime's mixed precision
    rc = run(tmp_path, MLP_FILE, "--budget", "64MiB", "--device", "rtx4090", "--policies", "none",
             "--host", "desktop-ddr5-2ch", "--at-batch", "2", "--compute-dtype", "bfloat16", "--json",
             str(tmp_path / "p.json"))  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "mixed bf16 compute / fp32 master" in out and "ours (the runtime)" in out
    with pytest.raises(SystemExit):
        run(tmp_path, MLP_FILE, "--budget", "64MiB", "--compute-dtype", "bfloat16")
    assert "--compute-dtype needs --host" in capsys.readouterr().err
