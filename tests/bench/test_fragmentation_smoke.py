"""The fragmentation benchmark's quick mode runs and writes its outputs in the documented schema (the
figures themselves are checked by the committed full results, not here)."""

import json

from bench import fragmentation
from swap.forecast.replay.replay import ALLOCATORS


def test_quick_mode_writes_the_schema(tmp_path):
    assert fragmentation.main(["--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "fragmentation.json").read_text())
    assert set(results) >= {"meta", "traces", "max_batch", "host_check"}
    assert {r["swapped"] for r in results["traces"]} == {False, True}
    for row in results["traces"]:
        assert {"model", "batch", "budget", "requested_peak", "allocators", "chunk_sweep"} <= set(row)
        assert set(row["allocators"]) == set(ALLOCATORS)
        for m in row["allocators"].values():
            for key in ("peak_allocated", "peak_reserved", "utilization", "fragmentation", "efficiency",
                        "steady_utilization", "num_maps", "num_unmaps", "us_per_op", "ok"):  # fmt: skip
                assert key in m
    assert set(results["max_batch"]["swap"]) == set(ALLOCATORS)
    assert results["host_check"]["equal"] is True
    for name in ("fragmentation.md", "fragmentation_timeline.png", "fragmentation_utilization.png",
                 "fragmentation_max_batch.png"):  # fmt: skip
        assert (tmp_path / name).stat().st_size > 0
