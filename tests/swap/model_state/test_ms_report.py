"""The report says, per optimizer step, what model state moved and what the host step cost: bytes in and out per
kind, the host optimizer's seconds and the part hidden, the stalls; and host and pinned bytes against the
prediction made before anything was allocated."""

from ms_training import gpt, train

import swap

STREAMED_64K = swap.ModelStatePolicy(placement="streamed", bucket_bytes="64KiB")


def test_per_step_rows_add_up_to_the_totals_and_the_model():
    got = train(steps=3, accum=2, manager=lambda m, o: swap.SwapManager(
        budget="1GiB", device="cpu", policy="window", model=m, optimizer=o, model_state=STREAMED_64K))  # fmt: skip
    report = got["manager"].report()
    ms = report["model_state"]
    params = list(gpt().parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    rows = ms["steps"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for kind in ("weights_in_bytes", "weights_out_bytes", "grads_out_bytes", "activations_in_bytes",
                 "activations_out_bytes", "demand_fetches"):  # fmt: skip
        assert sum(r[kind] for r in rows) == ms[kind], kind
    for r in rows:
        assert r["grads_out_bytes"] == 2 * weight_bytes  # two backward passes per step, every gradient copied out
        assert r["weights_in_bytes"] >= 2 * weight_bytes  # every forward brought every weight in
        assert r["weights_out_bytes"] == 0  # drops are clean: nothing written back
        assert r["state_in_bytes"] == r["state_out_bytes"] == 0  # the state never crosses the link
        assert r["host_step_seconds"] > 0
        assert r["host_step_hidden_seconds"] + r["host_step_exposed_seconds"] >= r["host_step_seconds"] - 1e-9
    assert abs(ms["host_step_seconds"] - sum(r["host_step_seconds"] for r in rows)) < 1e-9
    assert ms["host_bytes"] == ms["host_bytes_predicted"] and ms["state_bytes"] == ms["state_bytes_predicted"]
    text = str(report)
    assert "model state" in text and "host (predicted)" in text and "weights in" in text
