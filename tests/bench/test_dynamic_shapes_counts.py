"""bench.dynamic_shapes's count of the planning work in a run's second half (Note [A first-seen length's
refinement]): a refinement of a length first drawn at the iteration before is counted apart from one of a length
seen before, which the target counts against the run as it does a re-plan."""

from bench.dynamic_shapes import second_half


def test_second_half_splits_first_drawn_refinements():
    lengths = [64, 128, 64, 96, 64, 64, 112, 64, 96, 64]  # 112 first drawn at 6; 96 again at 8
    events = [(0, "profile"), (1, "profile"), (4, "refine"), (5, "replan"), (7, "refine"), (9, "refine"),
              (9, "profile")]  # fmt: skip
    # 4 is in the first half; 7 refines 112 (first drawn at 6), 9 refines 96 (drawn at 3 already).
    assert second_half(events, lengths) == {"profile": 1, "replan": 1, "refine_first": 1, "refine_again": 1}


def test_second_half_of_a_quiet_run():
    lengths = [128] * 4 + [120, 32]
    assert second_half([(0, "profile"), (1, "profile"), (5, "refine")], lengths) == {
        "profile": 0, "replan": 0, "refine_first": 1, "refine_again": 0}  # fmt: skip
