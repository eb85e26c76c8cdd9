"""SwapManager(model=, optimizer=) with the default strategy ("auto") on the models people start with: an
``nn.Sequential`` trains (the streamer's hooks and the operator profiler's share its children), and the
activations are planned by the joint keep / swap / recompute search, not swapped only."""

import functools

from ms_loops import assert_same, batch, gpt, loss_of, mlp, plain_step, run, within

import swap


def default(budget):
    def make(model, opt):
        return swap.SwapManager(budget=budget, device="cpu", model=model, optimizer=opt, bucket_bytes="64KiB",
                                min_bytes="4KiB")  # fmt: skip

    return make


def test_sequential_trains_with_the_default_strategy():
    """Profiling ends inside the pre-hooks of ``0`` (the streamer's begins the iteration that judges the last
    profiled one); the profiler's own hook on ``0`` ran next, without its kwargs, and training stopped."""
    got = run(mlp, plain_step, manager=default("64MiB"))
    assert_same(run(mlp, plain_step), got)
    assert got["manager"].report()["model_state"]["weights_in_bytes"] > 0


def big_batch_step(model, opt, it, log):
    opt.zero_grad()
    x, y = batch(it, n=16)
    loss = loss_of(model, x, y)
    loss.backward()
    log["loss"].append(loss.item())
    opt.step()


GPT = functools.partial(gpt, n_layer=4)


@functools.cache
def plain_gpt():
    meter = swap.LiveBytesMeter("cpu")
    return run(GPT, big_batch_step, meter=meter), meter.peak


def test_auto_plans_activations_with_the_joint_search_under_model_state():
    """The iterations begin at a bucket's first use (a module's pre-hook), not at a saved tensor: the operator
    profiler must still cut its iterations there, or it has no table and "auto" swaps only."""
    ref, peak = plain_gpt()
    budget = int(0.5 * peak)
    got = run(GPT, big_batch_step, manager=default(budget), meter=swap.LiveBytesMeter("cpu"))
    assert_same(ref, got)
    within(got, budget)
    sm = got["manager"]
    notes = sm.report()["notes"]
    assert not any("no operator was profiled" in n for n in notes), notes
    view = sm.joint_view
    assert view.decided and view.table is not None and view.table.ops and view.result is not None, notes
