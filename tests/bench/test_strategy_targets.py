"""The strategy targets as bench.strategies checks them, on hand-made strategy results: met, missed by how much,
and a joint strategy slower than a baseline named as such."""

from bench.strategy_targets import WORKLOADS, check, kept
from swap.forecast.strategies import Point, StrategyResult

GPT, RESNET, V100 = (next(w for w in WORKLOADS if w.key == k) for k in ("gpt2-medium-h100", "resnet50-h100",
                                                                         "resnet50-v100"))  # fmt: skip


def result(name: str, speeds: dict[int, float], blocker: str = "step 9 needs more") -> StrategyResult:
    """A strategy that fits up to its largest batch in ``speeds`` at those samples/s."""
    top = max(speeds)
    points = {n: Point(n, True, s, n / s, 0.0, 1 << 30, plan=f"{name}'s plan") for n, s in speeds.items()}
    for n in (100, 200, 300, 500, 1000):
        points.setdefault(n, Point(n, False, why="past its largest batch"))
    return StrategyResult(name, top, points, blocker)


def test_targets_met_and_missed_say_by_how_much():
    s = {"none": result("none", {100: 1000.0}), "window": result("window", {100: 1000.0, 500: 300.0, 1000: 200.0}),
         "checkpoint": result("checkpoint", {100: 950.0, 200: 900.0}),
         "auto": result("auto", {100: 1000.0, 200: 900.0, 300: 800.0, 500: 750.0, 1000: 500.0})}  # fmt: skip
    assert kept(s, 500) == 0.75 and kept(s, 1000, "window") == 0.2
    faster, five, largest = check(RESNET, s, [])
    assert faster["met"] and "at batches 100, 200, 300, 500, 1000" in faster["detail"]
    assert five["met"] and "keeps 75% at 5x (500)" in five["detail"]
    assert largest["met"] and "at 1000 it keeps 50% (window alone: 20%)" in largest["detail"]
    s["auto"].points[500] = Point(500, True, 250.0, 2.0, 1.0, 1 << 30, plan="auto's plan")
    faster, five, _ = check(RESNET, s, [])
    assert not faster["met"] and faster["detail"] == "slower than window at batch 500"
    assert not five["met"] and five["detail"].startswith("45 points short: keeps 25% at 5x (500)")
    assert "checkpointing every block stops fitting past batch 200: step 9 needs more" in five["detail"]


def test_a_batch_no_strategy_reaches_names_the_wall():
    s = {"none": result("none", {100: 1000.0}), "auto": result("auto", {100: 1000.0, 300: 900.0}, "logits too big")}
    wall = [{"bytes": 26 << 30, "op": "aten.mm.default", "module": "head"}]
    _, five, ten = check(GPT, s, wall)
    assert not five["met"]
    assert "5x (500) does not fit with any strategy: the largest batch is 300 (3.00x)" in five["detail"]
    assert "logits too big" in ten["detail"] and "aten.mm.default in head 26.0 GiB" in ten["detail"]
    (_, v100) = check(V100, s, wall)
    assert not v100["met"] and "10x (1000) does not fit" in v100["detail"] and "keeping >= 60 %: 300" in v100["detail"]
