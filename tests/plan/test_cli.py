"""``python -m swap.plan`` and ``swap.plan`` on wrong input: each mistake is refused before any planning, in the
words of the interface used (flags on the command line, arguments in Python), saying what to pass instead; a
budget that fits nothing says the smallest that fits and exits non-zero; the two tables label their
allocators."""

import inspect
import re
from pathlib import Path

import pytest
from tiny_models import TinyCNN, cnn_batch
from torch import nn

import swap
import swap.cli
from swap.cli import main
from swap.devices import profile
from swap.forecast.result import Plan, PolicyResult
from swap.forecast.strategies import StrategyResult
from swap.forecast.zoo import ZOO

ROOT = Path(__file__).resolve().parents[2]

MLP_FILE = '''
import torch
from torch import nn

def model_fn():  # 4 MiB of parameters, 16 MiB with gradients and AdamW's state
    return nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(512, 512), nn.ReLU())), nn.Linear(512, 10))

def batch_fn(n):
    return torch.randn(n, 512), torch.randint(0, 10, (n,))
'''


@pytest.fixture
def no_planning(monkeypatch):
    """swap.cli's plan replaced by one that records its arguments and plans nothing: the checks run first."""
    asked = {}

    def record(*args, **kwargs):
        asked.update(kwargs)
        raise ValueError("(planning stopped by the test)")

    monkeypatch.setattr(swap.cli, "plan", record)
    return asked


def refused(argv, capsys) -> str:
    """The error line of a command line refused with argparse's status 2 (after the usage lines)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.split("error: ", 1)[1]


@pytest.mark.parametrize("flag", ["--json", "--plot", "--plot-memory"])
def test_an_output_that_cannot_be_written_is_refused_before_planning(flag, tmp_path, no_planning, capsys):
    # It planned first, then died with a raw FileNotFoundError.
    unet = ["--model", "unet", "--size", "64", "--budget", "1GiB", "--quiet"]
    err = refused([*unet, flag, "/nonexistent/x.out"], capsys)
    assert f"{flag} /nonexistent/x.out: the folder /nonexistent does not exist" in err
    err = refused([*unet, flag, str(tmp_path)], capsys)
    assert f"{flag} {tmp_path}: is a folder; give a file name" in err
    assert not no_planning  # refused before planning


def test_an_unknown_built_in_model_is_named_with_the_known_ones(no_planning, capsys):
    # It said "--batch FILE.py:FUNCTION is needed with your own model".
    err = refused(["--model", "resnet5O", "--budget", "1GiB"], capsys)
    assert "--model resnet5O: no such built-in model (did you mean resnet50?); the built-ins are " in err
    assert ", ".join(ZOO) in err and "--batch" not in err
    assert "did you mean" not in refused(["--model", "nosuch", "--budget", "1GiB"], capsys)


@pytest.mark.parametrize("value, message", [
    ("-1GiB", "--budget must not be negative (got '-1GiB')"),  # was argparse's "expected one argument"
    ("banana", "--budget must be a number of bytes or a size string such as '12GiB'"),
    ("0", "--budget must be at least 1 byte"),
])  # fmt: skip
def test_a_bad_budget_is_refused_naming_budget(value, message, no_planning, capsys):
    assert message in refused(["--model", "unet", "--budget", value], capsys)


def test_counts_and_sizes_are_refused_naming_the_flag(no_planning, capsys):
    assert "--min-bytes must not be negative (got '-1MiB')" in refused(
        ["--model", "unet", "--budget", "1GiB", "--min-bytes", "-1MiB"], capsys)  # fmt: skip
    for flag in ("--max-batch", "--at-batch", "--size"):
        assert f"argument {flag}: must be at least 1, not -1" in refused(["--model", "unet", "--budget", "1GiB",
                                                                           flag, "-1"], capsys)  # fmt: skip


def test_every_option_has_help_text(capsys):
    # --policies, --max-batch, --device and --allocator had none.
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out.split("options:", 1)[1]
    entries = re.split(r"\n  (?=-)", "\n" + text)[1:]
    assert len(entries) > 15
    for entry in entries:
        head, _, rest = entry.partition("  ")
        said = (rest + " ".join(line.strip() for line in entry.splitlines()[1:])).strip()
        assert said, f"no help for {head.split()[0]}"


def test_the_guides_say_the_defaults_the_code_has():
    # The README said --optimizer defaults to AdamW; --help said sgd (the built-ins train with SGD). The options
    # are documented in docs/forecast.md, the manager's signature in docs/swap.md (issue 39 moved them there).
    flat = " ".join((ROOT / "docs" / "forecast.md").read_text().split())
    assert f"`--optimizer adamw|adam|sgd` (default: {swap.cli.OPTIMIZER_DEFAULT})" in flat
    assert "`--strategies every|off|NAME,...`" in flat
    # And the manager's signature, as the guide writes it, is the code's (recompute= and strategy= were missing).
    flat = " ".join((ROOT / "docs" / "swap.md").read_text().split())
    parts = []
    for p in inspect.signature(swap.SwapManager).parameters.values():
        if p.kind is p.KEYWORD_ONLY and "*" not in parts:
            parts.append("*")
        parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}".replace("'", '"'))
    assert f"`swap.SwapManager({', '.join(parts)})`" in flat


def test_strategies_every_and_the_strategy_named_all(no_planning, capsys):
    # "--strategies all" meant every strategy, and "all" is also a strategy's name (swap every saved tensor).
    unet = ["--model", "unet", "--size", "64", "--budget", "1GiB", "--quiet"]
    assert main([*unet, "--strategies", "every"]) == 2
    assert no_planning["strategies"] == swap.STRATEGIES
    assert main([*unet]) == 2 and no_planning["strategies"] == swap.STRATEGIES  # the default
    assert main([*unet, "--strategies", "all,"]) == 2 and no_planning["strategies"] == ("all",)
    capsys.readouterr()
    assert main([*unet, "--strategies", "all"]) == 2  # the old spelling: every strategy, with a warning
    assert no_planning["strategies"] == swap.STRATEGIES
    assert "--strategies all means every strategy, as before; spell it --strategies every" in capsys.readouterr().err
    assert "choose every, off, or among" in refused([*unet, "--strategies", "al"], capsys)


def test_a_budget_that_fits_nothing_says_the_smallest_that_fits_and_exits_non_zero(tmp_path, capsys):
    # "--budget 3MiB" printed "none fits" on every row and exited 0; "--budget 1KiB" said "raise capacity or
    # lower chunk_size", vmalloc's arguments, not swap.plan's.
    f = tmp_path / "mlp.py"
    f.write_text(MLP_FILE)
    args = ["--model", str(f), "--batch", str(f), "--policies", "none,window", "--strategies", "off", "--quiet"]
    for budget in ("3MiB", "1KiB"):
        assert main([*args, "--budget", budget]) == swap.cli.NOTHING_FITS
        out, err = capsys.readouterr()
        assert "capacity" not in out + err and "chunk_size" not in out + err
        assert f"nothing fits a budget of {'3.00 MiB' if budget == '3MiB' else '1.00 KiB'}: batch 1 fits from" in out
        smallest = re.search(rf"no batch fits --budget {budget}: pass --budget (\d+)MiB or more", err)
        assert smallest, err
    assert main([*args, "--budget", f"{smallest[1]}MiB"]) == 0  # what it said fits
    assert re.search(r"\nnone +\S+|\nwindow +[1-9]", capsys.readouterr().out)


def test_the_smallest_budget_is_the_smallest_that_fits_batch_1():
    def plan(budget):
        return swap.plan(TinyCNN, cnn_batch, budget=budget, device="a100-40gb", policies=("none", "window"),
                         strategies=(), min_bytes="16KiB", max_batch=1, progress=False)  # fmt: skip

    p = plan("1KiB")  # less than one of vmalloc's chunks: not a vmalloc error, nothing fits
    assert p.fits_nothing and p.min_budget >= 2 << 20 and p.min_budget_policy in ("none", "window")
    assert "batch 1 fits from a budget of" in p.table()
    assert plan(p.min_budget).max_batch[p.min_budget_policy] == 1
    assert plan(p.min_budget - (p.min_budget >> 7)).fits_nothing


def test_swap_plan_says_what_to_pass_for_a_model():
    # A model without parameters raised torch's "optimizer got an empty parameter list"; a model instead of a
    # function blamed the model's forward ("missing 1 required positional argument").
    with pytest.raises(ValueError, match="the model that model_fn builds has no parameters: swap.plan plans "
                                         "training steps"):  # fmt: skip
        swap.plan(lambda: nn.ReLU(), cnn_batch, budget="1GiB", progress=False)
    with pytest.raises(TypeError, match=r"model_fn must build the model when called, not be the model: got a "
                                        r"TinyCNN instance.*pass TinyCNN \(the class\) or lambda: TinyCNN\(...\)"):
        swap.plan(TinyCNN(), cnn_batch, budget="1GiB", progress=False)
    with pytest.raises(TypeError, match=r"batch_fn must be a function: batch_fn\(n\) returns a batch of n"):
        swap.plan(TinyCNN, cnn_batch(4), budget="1GiB", progress=False)
    with pytest.raises(TypeError, match=r"policies takes a tuple of names, such as \('window',\), not a string"):
        swap.plan(TinyCNN, cnn_batch, budget="1GiB", policies="window", progress=False)


def test_the_command_line_says_what_to_pass_for_a_model(tmp_path, capsys):
    f = tmp_path / "built.py"
    f.write_text("from torch import nn\nmodel = nn.Linear(4, 4)\ndef batch_fn(n):\n    return None\n")
    err = refused(["--model", f"{f}:model", "--batch", str(f), "--budget", "1GiB"], capsys)
    assert f"--model {f}:model must build the model when called, not be the model: got a Linear instance" in err


def test_each_largest_batch_says_which_allocator_found_it():
    # One output gave the window policy two largest batches, 38 in the policy table (vmalloc replayed) and 39 in
    # the strategy table (the ideal allocator), unlabelled.
    p = Plan("m", 1 << 30, profile("h100-pcie"), "vmalloc", {"window": PolicyResult("window", 38)},
             strategies={"window": StrategyResult("window", 39), "none": StrategyResult("none", 12)})  # fmt: skip
    table = p.table()
    assert "swap policies: each swapped run replayed on vmalloc" in table
    assert "strategies: whole keep / swap / recompute plans, planned on the ideal allocator" in table
    assert "largest batch as a policy (its run replayed on vmalloc) vs as a strategy (on the ideal allocator): " \
           "window 38 vs 39" in table  # fmt: skip
    assert p.to_dict()["strategies_allocator"] is None and p.to_dict()["allocator"] == "vmalloc"


def test_the_ci_package_check_still_plans(capsys, tmp_path):
    # .ci/check_package.sh runs this from an installed wheel.
    out = tmp_path / "p.json"
    assert main(["--model", "unet", "--size", "64", "--budget", "1GiB", "--max-batch", "4", "--json", str(out),
                 "--quiet"]) == 0  # fmt: skip
    assert out.stat().st_size > 0
