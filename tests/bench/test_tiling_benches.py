"""The tiling benchmarks' quick modes run, hold their budgets and write their outputs (the full figures are
the committed results in bench/results/tiling_cpu.md and tiled_head.md)."""

import json

from bench import tiled_head, tiling_cpu


def test_tiling_cpu_quick_holds_the_budget_and_beats_checkpoint_sequential(tmp_path):
    assert tiling_cpu.main(["--quick", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "tiling_cpu.json").read_text())
    assert all(row["held_within_budget"] and row["budget"] * 10 <= row["untiled_peak"] + 10 for row in r["sweep"])
    c = r["compare"]
    assert c["tiled_held"] and c["pixel_ratio_vs_checkpoint"] >= 4  # the target, on real CPU runs
    assert (tmp_path / "tiling_cpu.png").stat().st_size > 0 and (tmp_path / "tiling_cpu.md").exists()


def test_tiled_head_quick_fits_a_larger_batch(tmp_path):
    assert tiled_head.main(["--quick", "--policies", "none", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "tiled_head.json").read_text())["policies"]["none"]
    assert r["tiled_head"]["batch"] > r["untiled_head"]["batch"] > 0
