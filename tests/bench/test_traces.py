"""Trace capture, file format, snapshot import, and the swapped trace."""

import pickle

import pytest

from bench.replay import measure
from bench.swap_trace import sequence_from_trace, swapped
from bench.traces import ALLOC, FREE, SAVE, TAG, TAGS, USE, Trace, capture, import_snapshot, live_peak

MiB = 1 << 20


@pytest.fixture(scope="module")
def small_trace():
    return capture("resnet50", 4, steps=2, size=64, progress=False)


def test_capture_records_a_balanced_tagged_trace(small_trace, tmp_path):
    t = small_trace
    assert len(t.iterations()) == 2
    alive = {}
    for o, i, s in zip(t.op.tolist(), t.id.tolist(), t.size.tolist()):
        if o == ALLOC:
            assert i not in alive
            alive[i] = s
        elif o == FREE:
            assert alive.pop(i) == s
    tags = {TAGS[k] for k in t.tag[t.op == ALLOC].tolist()}
    assert tags == set(TAGS)
    # What stays after the run: weights, the last gradients, the optimizer's momentum, the last batch.
    left = {TAGS[t.tag[(t.op == ALLOC) & (t.id == i)][0]] for i in alive}
    assert {"weight", "grad", "optimizer_state"} <= left <= {"weight", "grad", "optimizer_state", "input"}
    assert (t.op == SAVE).sum() == (t.op == USE).sum() > 0
    assert t.flops.sum() > 0
    back = Trace.load(t.save(tmp_path / "t.npz"))
    assert (back.op == t.op).all() and back.meta == t.meta


def test_unknown_model_and_bad_files(tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        capture("vgg", 4)
    (tmp_path / "x.pickle").write_bytes(pickle.dumps({"segments": []}))
    with pytest.raises(ValueError, match="not a PyTorch memory snapshot"):
        import_snapshot(tmp_path / "x.pickle")


def test_import_of_a_vmalloc_snapshot_replays(tmp_path):
    import vmalloc

    a = vmalloc.Arena("host", capacity="64MiB", history=1000)
    ps = [a.malloc(n) for n in (3 * MiB, 5 * MiB, 100, 7 * MiB)]
    a.free(ps[1])
    keep = ps[2:]
    path = vmalloc.dump_snapshot(tmp_path / "snap.pickle", a)
    t = import_snapshot(path)
    assert (t.op == ALLOC).sum() == 4 and (t.op == FREE).sum() == 1
    # Sizes as the allocator recorded them: whole 2 MiB chunks, 512 B for the small one.
    assert live_peak(t) == 4 * MiB + 6 * MiB + 512 + 8 * MiB
    assert measure(t, "pytorch_native")["ok"]
    del keep


def test_swapped_trace_stays_under_the_budget_and_balances(small_trace):
    seq = sequence_from_trace(small_trace)
    floor = seq.step_floor()
    budget = (floor + seq.no_swap_peak()) // 2
    s = swapped(small_trace, budget)
    assert live_peak(s) <= budget < live_peak(small_trace)
    alive = set()
    for o, i in zip(s.op.tolist(), s.id.tolist()):
        if o == ALLOC:
            assert i not in alive
            alive.add(i)
        elif o == FREE:
            alive.remove(i)
    assert s.meta["swap"]["budget"] == budget
    assert (s.tag[s.op == ALLOC] == TAG["activation"]).sum() > (small_trace.tag[small_trace.op == ALLOC] == 1).sum()
