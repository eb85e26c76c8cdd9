"""Every strategy side by side in swap.plan: the baselines and the joint strategy from one
capture, their largest batches and speeds, the table, the JSON keyed by name, and the plot."""

import json
import sys

import pytest
import torch

import swap
from swap.capture import capture
from swap.cli import main
from swap.devices import profile
from swap.forecast import zoo
from swap.forecast.from_trace import sequence_from_trace
from swap.forecast.strategies import MULTIPLES, STRATEGIES, StrategyBook
from swap.joint.search import BASELINES

BUDGET = "24MiB"


def small_gpt() -> torch.nn.Module:
    return zoo.gpt(n_layer=4, n_head=4, d_model=64, vocab=256, seq_len=64)


def batch_fn(n: int):
    return torch.randint(0, 256, (n, 64)), torch.randint(0, 256, (n, 64))


def loss_fn(model, batch):
    x, y = batch
    return zoo.loss_fn(model, model(x), y)


_PLANS = {}


def planned(**kw) -> swap.Plan:
    key = tuple(sorted(kw.items()))
    if key not in _PLANS:
        _PLANS[key] = swap.plan(small_gpt, batch_fn, loss_fn, budget=BUDGET, device="h100-sxm", allocator=None,
                                min_bytes="16KiB", progress=False, **kw)  # fmt: skip
    return _PLANS[key]


def test_every_baseline_and_the_joint_policy_from_one_capture():
    p = planned(batch=3)
    assert list(p.strategies) == list(STRATEGIES) == [*BASELINES, "auto"]
    s = p.strategies
    plain = s["none"].max_batch
    assert plain == p.max_batch["none"] > 0  # the same no-swap batch as the policies' (ideal allocator)
    assert s["checkpoint"].max_batch > plain and s["window"].max_batch > plain
    assert s["auto"].max_batch >= max(r.max_batch for name, r in s.items() if name != "auto")
    # Compared at the batch asked for, the multiples of the no-swap batch and every largest batch.
    batches = {3} | {k * plain for k in MULTIPLES} | {r.max_batch for r in s.values()}
    for r in s.values():
        assert set(r.points) == batches
        for n, pt in r.points.items():
            assert pt.fits == (n <= r.max_batch)
            if pt.fits:
                assert pt.samples_per_s == pytest.approx(n / pt.step_time)
                assert pt.peak <= 24 << 20
        assert r.blocker  # why one more sample does not fit
    # The joint strategy is never slower than a baseline where that baseline fits, and is "none" where it fits.
    for n in batches:
        mine = s["auto"].at(n)
        for name in BASELINES:
            theirs = s[name].at(n)
            if theirs.fits:
                assert mine.fits and mine.samples_per_s >= theirs.samples_per_s * (1 - 1e-9), (name, n)
    assert s["auto"].at(plain).plan == s["none"].at(plain).plan
    # What each costs: checkpointing recomputes and copies nothing; swapping copies and recomputes nothing.
    top = s["checkpoint"].at_max
    assert top.recomputed_bytes > 0 and top.recompute_seconds > 0 and top.copied_bytes == 0
    w = s["window"].at_max
    assert w.copied_bytes > 0 and w.recomputed_bytes == 0 and w.recompute_seconds == 0
    assert s["all"].at_max.copied_bytes >= w.copied_bytes


def test_the_joint_policys_largest_batch_is_searched_not_borrowed():
    """One sample past auto's largest batch, a fresh search over mixed plans (from new captures) finds nothing
    that fits: its largest batch is its own, not the best baseline's restated."""
    p = planned(batch=3)
    n = p.strategies["auto"].max_batch
    dev = profile("h100-sxm")

    def trace_at(k: int):
        return capture(small_gpt, batch_fn, k, loss_fn, name="small_gpt")

    book = StrategyBook(trace_at, lambda k: sequence_from_trace(trace_at(k), cost=dev, min_bytes=16 << 10), dev,
                        24 << 20, 16 << 10)  # fmt: skip
    assert book.fits("auto", n) and not book.fits("auto", n + 1)
    assert p.strategies["auto"].trials >= 1  # judged at n + 1 by the planner too


def test_the_table_json_and_plot(tmp_path):
    p = planned(batch=3)
    table = p.table()
    for name, r in p.strategies.items():
        assert any(line.split()[:2] == [name, str(r.max_batch)] for line in table.splitlines()), name
    assert "at batch 3" in table and f"past batch {p.strategies['auto'].max_batch}:" in table
    d = json.loads(json.dumps(p.to_dict()))
    assert set(d["strategies"]) == set(STRATEGIES)
    assert d["strategies"]["auto"]["max_batch"] == p.strategies["auto"].max_batch
    assert d["strategies"]["window"]["points"]["3"]["samples_per_s"] == p.strategies["window"].at(3).samples_per_s
    png = p.plot_strategies(tmp_path / "s.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_strategies_can_be_chosen_or_left_out_and_bad_ones_are_named():
    p = swap.plan(small_gpt, batch_fn, loss_fn, budget=BUDGET, device="h100-sxm", allocator=None, min_bytes="16KiB",
                  policies=("none",), strategies=("checkpoint", "auto"), progress=False)  # fmt: skip
    assert list(p.strategies) == ["checkpoint", "auto"]
    assert p.strategies["auto"].max_batch >= p.strategies["checkpoint"].max_batch
    assert "strategy" not in swap.plan(small_gpt, batch_fn, loss_fn, budget=BUDGET, allocator=None,
                                       policies=("none",), strategies=(), progress=False).table()  # fmt: skip
    with pytest.raises(ValueError, match="unknown strategy 'remat'"):
        swap.plan(small_gpt, batch_fn, loss_fn, budget=BUDGET, strategies=("remat",), progress=False)
    with pytest.raises(ValueError, match="batch must be a positive int"):
        swap.plan(small_gpt, batch_fn, loss_fn, budget=BUDGET, batch=0, progress=False)


USER_FILE = """
import torch
from swap.forecast import zoo

def model_fn():
    return zoo.gpt(n_layer=2, n_head=2, d_model=32, vocab=64, seq_len=32)

def batch_fn(n):
    return torch.randint(0, 64, (n, 32)), torch.randint(0, 64, (n, 32))

def loss_fn(model, batch):
    x, y = batch
    return zoo.loss_fn(model, model(x), y)
"""


def test_the_command_line_plots_and_writes_json_keyed_by_strategy(tmp_path, capsys, monkeypatch):
    f = tmp_path / "m.py"
    f.write_text(USER_FILE)
    base = ["--model", f"{f}:model_fn", "--batch", f"{f}:batch_fn", "--loss", f"{f}:loss_fn", "--budget", "4MiB",
            "--allocator", "ideal", "--min-bytes", "4KiB", "--policies", "none,window", "--quiet"]  # fmt: skip
    out_json, png = tmp_path / "p.json", tmp_path / "p.png"
    assert main([*base, "--at-batch", "2", "--json", str(out_json), "--plot", str(png)]) == 0
    d = json.loads(out_json.read_text())
    assert set(d["strategies"]) == set(STRATEGIES) and "2" in d["strategies"]["auto"]["points"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "auto" in capsys.readouterr().out
    # Without matplotlib, --plot stops before planning and says what to install.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit):
        main([*base, "--plot", str(tmp_path / "q.png")])
    assert "pip install 'vmalloc-swap[plot]'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--strategies", "none,remat"])
    assert "unknown strategy 'remat'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--plot-memory", str(tmp_path / "m.png")])
    assert "--plot-memory: " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--strategies", "off", "--at-batch", "2"])
    assert "drop --strategies off, or drop --at-batch" in capsys.readouterr().err
