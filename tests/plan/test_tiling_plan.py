"""The tiling planner: predicted peak and step time per strategy, the largest image, and the CLI's answer."""

from __future__ import annotations

from torch import nn

from swap.cli import main
from swap.devices import profile
from swap.tiling.plan.largest import IMAGE_STRATEGIES, image_graph, largest_image, plan_image

DEV = profile("rtx2080ti-11gb")


def small_vgg() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True),
        nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )  # fmt: skip


def test_tiled_plan_fits_where_untiled_does_not_and_costs_its_recompute() -> None:
    model = small_vgg()
    graph = image_graph(model, 256)
    plans = {s: plan_image(graph, 256, s, 2 << 20, DEV) for s in IMAGE_STRATEGIES}
    untiled = plan_image(graph, 256, "untiled", 1 << 40, DEV)
    assert not plans["untiled"].fits and untiled.peak > 2 << 20
    assert plans["tiled"].fits and plans["tiled"].peak <= 2 << 20 < untiled.peak
    # every tile is computed twice (forward, backward's recompute) with its halo: slower than untiled
    assert plans["tiled"].seconds > untiled.seconds
    assert "tiles" in plans["tiled"].describe


def test_largest_image_grows_with_tiling_and_with_the_budget() -> None:
    model = small_vgg()
    base = largest_image(model, 4 << 20, DEV, "untiled", step=16)
    tiled = largest_image(model, 4 << 20, DEV, "tiled", step=16, limit=2048)
    more = largest_image(model, 8 << 20, DEV, "untiled", step=16)
    assert base is not None and tiled is not None and more is not None
    assert tiled.side >= 2 * base.side and more.side > base.side
    assert tiled.peak <= 4 << 20 and tiled.fits
    assert not plan_image(image_graph(model, base.side + 16), base.side + 16, "untiled", 4 << 20, DEV).fits


def test_cli_answers_the_largest_image(tmp_path, capsys) -> None:
    f = tmp_path / "m.py"
    f.write_text("from torch import nn\n"
                 "def model_fn():\n"
                 "    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),\n"
                 "                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))\n"
                 "def batch_fn(n):\n    raise AssertionError('not needed for --largest-image')\n")  # fmt: skip
    rc = main(["--model", f"{f}:model_fn", "--batch", f"{f}:batch_fn", "--budget", "4MiB", "--device",
               "rtx2080ti-11gb", "--largest-image", "--quiet"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[2:]}
    assert set(rows) == set(IMAGE_STRATEGIES)
    side = {k: int(v.split("x")[0]) for k, v in rows.items()}
    assert side["tiled"] > side["untiled"] > 0


def test_with_a_device_profile_the_plan_is_no_slower_and_still_fits() -> None:
    from swap.tiling.plan.choose import plan_tiles
    from swap.tiling.plan.cost import estimate

    graph = image_graph(small_vgg(), 256)
    budget = 2 << 20
    fewest = plan_tiles(graph, budget)  # no profile: the fewest tiles that fit
    fastest = plan_tiles(graph, budget, dev=DEV)
    assert fewest.peak <= budget and fastest.peak <= budget
    assert fastest.seconds <= estimate(graph, fewest.segments, DEV).seconds
    assert fastest.seconds >= fastest.untiled.seconds  # tiles recompute: never faster than untiled


def test_border_tiles_count_their_input_at_its_real_size() -> None:
    from swap.tiling.plan.cost import Segment, tile_chain, tile_shapes

    # 10 positions in 3 tiles: outputs [0, 4), [4, 8), [8, 10); a 3x3 convolution with padding 1 reads
    # inputs [0, 5), [3, 9), [7, 10) of the image (5, 6 and 3 real positions; the borders' padding is a copy)
    graph = image_graph(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()), 10)
    (start, end), = graph.runs()
    seg = Segment(start, end, (3, 3))
    shapes = tile_shapes(graph, seg)
    assert sum(s.count for s in shapes) == 9
    chains = [(s.count, tile_chain(graph, seg, s, False)) for s in shapes]
    assert sum(n * c[0].out_bytes for n, c in chains) == (5 + 6 + 3) ** 2 * 3 * 4  # float32, batch 1
    # the tiles' outputs partition the untiled output: their FLOPs add up to the untiled operator's
    conv = graph.nodes[start]
    tiled_flops = sum(n * op.flops for n, c in chains for op in c if op.name == conv.name)
    assert abs(tiled_flops - conv.flops) <= 1e-9 * conv.flops
