"""The report says what it measured: on CPU the budget is checked as live tensor bytes between operators
(swap.LiveBytesMeter), which cannot see memory an operator allocates and frees inside itself (a convolution's
workspace), so the report labels that figure as such instead of calling it the device's peak."""

from training import KiB, run

import swap


def test_cpu_report_labels_the_peak_as_between_op_live_bytes():
    got = run("resnet", 3, manager=lambda: swap.SwapManager(budget="64GiB", device="cpu", min_bytes=16 * KiB))
    r = got["manager"].report()
    assert r["peak_measured_inside_ops"] is False
    assert "between operators" in r["memory_source"]
    text = str(r)
    assert "peak (between-op live bytes)" in text and "peak device memory" not in text
    assert any("memory an operator allocates and frees inside itself is not seen" in n and "on a GPU" in n
               for n in r["notes"])  # fmt: skip

