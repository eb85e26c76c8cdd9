"""Fault injection: FAKECUDA_FAIL and fakecuda_set_faults make the n-th call of an entry point (and every
later one, or only that one) fail with a chosen CUresult, changing nothing; bad text is an error, never
ignored; call counters drive fault sweeps."""

import pytest

from fakecuda.api import CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, CudaError
from fakecuda.isolated import run_isolated


@pytest.fixture
def g(fakecuda):
    return fakecuda.granularity()


def create_results(fc, g, n):
    """The CUresult of n cuMemCreate calls (successful ones released again)."""
    codes = []
    for _ in range(n):
        try:
            fc.release(fc.create(g))
            codes.append(0)
        except CudaError as e:
            codes.append(e.code)
    return codes


def test_nth_call_and_every_later_one_fail(fakecuda, g):
    fakecuda.set_faults("cuMemCreate:3:CUDA_ERROR_OUT_OF_MEMORY")
    assert create_results(fakecuda, g, 5) == [0, 0, 2, 2, 2]
    assert fakecuda.calls("cuMemCreate") == 5


def test_once_fails_a_single_call(fakecuda, g):
    base = fakecuda.reserve(4 * g)
    handles = [fakecuda.create(g) for _ in range(4)]
    fakecuda.set_faults("cuMemMap:2:CUDA_ERROR_INVALID_VALUE:once")
    codes = [fakecuda.call("cuMemMap", base + i * g, g, 0, h, 0) for i, h in enumerate(handles)]
    assert codes == [0, CUDA_ERROR_INVALID_VALUE, 0, 0]
    assert fakecuda.live()["mappings"] >= 3
    fakecuda.unmap(base, g)
    fakecuda.unmap(base + 2 * g, 2 * g)
    for h in handles:
        fakecuda.release(h)
    fakecuda.free_reservation(base, 4 * g)


def test_several_items_and_numeric_results(fakecuda, g):
    fakecuda.set_faults(" cuMemCreate:2:2 , cuEventCreate:1:CUDA_ERROR_INVALID_VALUE:once")
    assert create_results(fakecuda, g, 2) == [0, CUDA_ERROR_OUT_OF_MEMORY]
    with pytest.raises(CudaError) as err:
        fakecuda.event()
    assert err.value.code == CUDA_ERROR_INVALID_VALUE
    fakecuda.destroy_event(fakecuda.event())


STEPS = ["cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease",
         "cuMemAddressFree"]


@pytest.mark.parametrize("entry", STEPS)
def test_an_injected_fault_changes_nothing(fakecuda, g, entry):
    """Run reserve .. free with `entry` failing once: the failed call leaves everything as it was, so doing
    it again succeeds and the whole sequence ends with nothing left over."""
    before, used = fakecuda.live(), fakecuda.used_bytes()
    fakecuda.set_faults(f"{entry}:1:CUDA_ERROR_OUT_OF_MEMORY:once")
    state = {}

    def step(name):
        if name == "cuMemAddressReserve":
            state["ptr"] = fakecuda.reserve(g)
        elif name == "cuMemCreate":
            state["h"] = fakecuda.create(g)
        elif name == "cuMemMap":
            fakecuda.map(state["ptr"], g, state["h"])
        elif name == "cuMemSetAccess":
            fakecuda.set_access(state["ptr"], g)
            fakecuda.poke(state["ptr"], b"ok")
        elif name == "cuMemUnmap":
            fakecuda.unmap(state["ptr"], g)
        elif name == "cuMemRelease":
            fakecuda.release(state["h"])
        else:
            fakecuda.free_reservation(state["ptr"], g)

    failed = 0
    for name in STEPS:
        live, used_now = fakecuda.live(), fakecuda.used_bytes()
        try:
            step(name)
        except CudaError as e:
            assert (e.call, e.code) == (name, CUDA_ERROR_OUT_OF_MEMORY) and name == entry
            failed += 1
            assert fakecuda.live() == live and fakecuda.used_bytes() == used_now
            if name == "cuMemSetAccess":
                assert fakecuda.access_flags(state["ptr"]) == 0  # still inaccessible
            if name == "cuMemUnmap":
                assert fakecuda.peek(state["ptr"], 2) == b"ok"  # still mapped and accessible
            step(name)  # the same call again: nothing of the failed one is in its way
    assert failed == 1 and fakecuda.calls(entry) == 2
    assert fakecuda.live() == before and fakecuda.used_bytes() == used


def test_counters_count_every_call_and_reset_with_the_rules(fakecuda, g):
    fakecuda.set_faults("")
    fakecuda.release(fakecuda.create(g))
    fakecuda.call("cuMemRelease", 1)  # failing calls count too
    assert (fakecuda.calls("cuMemCreate"), fakecuda.calls("cuMemRelease"), fakecuda.calls("cuMemMap")) == (1, 2, 0)
    fakecuda.set_faults("")
    assert fakecuda.calls("cuMemRelease") == 0


@pytest.mark.parametrize("spec, message", [
    ("cuMemCreat:1:CUDA_ERROR_OUT_OF_MEMORY", "'cuMemCreat' is not an entry point of the emulated driver"),
    ("cuMemCreate:0:CUDA_ERROR_OUT_OF_MEMORY", "must be a whole number from 1"),
    ("cuMemCreate:x:CUDA_ERROR_OUT_OF_MEMORY", "must be a whole number from 1"),
    ("cuMemCreate:1:CUDA_ERROR_OUT_OF_MEMRY", "is not a CUresult name"),
    ("cuMemCreate:1:CUDA_SUCCESS", "not a fault"),
    ("cuMemCreate:1", "expected 3 or 4 fields"),
    ("cuMemCreate:1:2:twice", "may only be 'once'"),
    ("cuMemCreate:1:2,,cuMemMap:1:2", "expected 3 or 4 fields"),
])
def test_bad_text_is_an_error_and_changes_nothing(fakecuda, g, spec, message):
    fakecuda.set_faults("cuMemCreate:1:CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(ValueError, match="fault item .*" + message):
        fakecuda.set_faults(spec)
    assert create_results(fakecuda, g, 1) == [CUDA_ERROR_OUT_OF_MEMORY]  # the old rules still hold


def test_unknown_entry_point_error_lists_the_known_ones(fakecuda):
    with pytest.raises(ValueError, match="use one of: cuInit, .*cuMemCreate, .*cuStreamWaitEvent"):
        fakecuda.set_faults("cuMemAlloc:1:2")


def test_environment_variable_applies_from_the_start():
    proc = run_isolated("""
        import fakecuda
        fc = fakecuda.driver()
        g = fc.granularity()
        codes = []
        for _ in range(3):
            try:
                fc.create(g)
                codes.append(0)
            except fakecuda.CudaError as e:
                codes.append(e.code)
        print(codes, fc.calls("cuMemCreate"))
    """, FAKECUDA_FAIL="cuMemCreate:2:CUDA_ERROR_OUT_OF_MEMORY:once,cuMemMap:1:1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[0, 2, 0] 3"


def test_bad_environment_variable_fails_cuinit_and_says_why():
    proc = run_isolated("""
        import ctypes, fakecuda
        fc = fakecuda.FakeCuda()
        print(fc.call("cuInit", 0))
        print(fc.misuses()[-1])
    """, FAKECUDA_FAIL="cuMemCreate:3")
    assert proc.returncode == 0, proc.stderr
    assert "fakecuda: FAKECUDA_FAIL=cuMemCreate:3 is not valid: fault item 'cuMemCreate:3'" in proc.stderr
    code, reason = proc.stdout.strip().splitlines()
    assert code == "1" and "fakecuda is misconfigured: FAKECUDA_FAIL" in reason
