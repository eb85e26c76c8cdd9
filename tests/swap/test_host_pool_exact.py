"""The host pool pins exactly its blocks and unpins every one at close (Note [Exact-size pinned blocks]).

A recording pinner stands in for the CUDA driver, so the accounting is checked without a GPU; tests/gpu
checks the real registration with cuPointerGetAttribute.
"""

import sys
import warnings

import pytest
import torch

from swap.runtime.machine.host_pool import PAGE, HostPool, HostPoolExhausted, PinningUnavailable

MiB = 1 << 20


class RecordingPinner:
    def __init__(self):
        self.pinned: dict[int, int] = {}  # address -> bytes
        self.calls: list[tuple[str, int]] = []

    def pin(self, addr, nbytes):
        assert addr not in self.pinned, "a block was pinned twice"
        self.pinned[addr] = nbytes
        self.calls.append(("pin", addr))

    def unpin(self, addr):
        assert addr in self.pinned, "unpin of a range that is not pinned"
        del self.pinned[addr]
        self.calls.append(("unpin", addr))


def test_pinned_bytes_equal_the_blocks_exactly_and_all_are_unpinned_at_close():
    pinner = RecordingPinner()
    pool = HostPool(pinned=True, block_size=3 * MiB + 512, pinner=pinner)
    held = [pool.alloc(MiB + 1), pool.alloc(2 * MiB), pool.alloc(5 * MiB)]  # the last needs its own block
    assert pool.reserved == (3 * MiB + 512) + 5 * MiB
    assert sum(pinner.pinned.values()) == pool.reserved == pool.pinned_bytes
    for addr in pinner.pinned:
        assert addr % PAGE == 0, "blocks are page-aligned, so registration pins no neighbouring bytes"
    # Each view lies inside its pinned block.
    for hb in held:
        base = hb.view.data_ptr() - hb.offset
        assert pinner.pinned[base] >= hb.offset + hb.nbytes
    pool.close()
    assert pinner.pinned == {} and pool.pinned_bytes == 0 and pool.reserved == 0
    assert [c for c, _ in pinner.calls] == ["pin", "pin", "unpin", "unpin"]


def test_no_power_of_two_rounding_under_a_limit():
    pinner = RecordingPinner()
    pool = HostPool(pinned=True, limit=5 * MiB, block_size=3 * MiB, pinner=pinner)
    pool.alloc(3 * MiB)
    pool.alloc(MiB + 4096)  # the last block is only what the limit leaves (2 MiB), not 4 MiB
    assert sorted(pinner.pinned.values()) == [2 * MiB, 3 * MiB]
    with pytest.raises(HostPoolExhausted, match="host_pool_limit"):
        pool.alloc(2 * MiB)
    assert pool.pinned_bytes == 5 * MiB
    pool.close()
    assert pool.pinned_bytes == 0


def test_unpinned_pool_never_calls_the_pinner():
    pinner = RecordingPinner()
    pool = HostPool(pinned=False, block_size=MiB, pinner=pinner)
    pool.alloc(100)
    pool.close()
    assert pinner.calls == [] and pool.pinned_bytes == 0


def test_views_stay_valid_after_close():
    pool = HostPool(pinned=True, block_size=MiB, pinner=RecordingPinner())
    hb = pool.alloc(4096)
    hb.view.copy_(torch.arange(4096, dtype=torch.int64).to(torch.uint8))
    pool.close()
    # The numpy block is still owned by the view: reading it is safe (it is merely unpinned now).
    assert torch.equal(hb.view, torch.arange(4096, dtype=torch.int64).to(torch.uint8))


def test_pinning_failure_leaves_the_pool_consistent():
    class Refusing(RecordingPinner):
        def pin(self, addr, nbytes):
            raise RuntimeError("cuMemHostRegister failed: CUDA_ERROR_OUT_OF_MEMORY")

    pool = HostPool(pinned=True, block_size=MiB, pinner=Refusing())
    with pytest.warns(PinningUnavailable, match="cuMemHostRegister failed: CUDA_ERROR_OUT_OF_MEMORY"):
        pool.alloc(100)  # served from a pageable block (Note [Pageable fallback])
    assert pool.reserved == MiB and pool.pinned_bytes == 0 and pool.used == 512
    pool.close()
    assert pool.reserved == 0


class FailingPinner(RecordingPinner):
    """Pins ``works`` blocks, then fails as cuMemHostRegister does when the locked-memory limit is reached."""

    def __init__(self, works: int):
        super().__init__()
        self.works = works

    def pin(self, addr, nbytes):
        if len(self.pinned) >= self.works:
            self.calls.append(("failed", addr))
            raise RuntimeError("swap host pool: cuMemHostRegister(1048576 bytes) failed: CUDA_ERROR_NOT_PERMITTED")
        super().pin(addr, nbytes)


def test_a_failing_registration_warns_once_and_falls_back_to_pageable_memory():
    pinner = FailingPinner(works=1)
    pool = HostPool(pinned=True, block_size=MiB, pinner=pinner)
    first = pool.alloc(MiB)  # pinned
    with pytest.warns(PinningUnavailable, match="CUDA_ERROR_NOT_PERMITTED.*pageable.*synchronous") as caught:
        second = pool.alloc(MiB)
        third = pool.alloc(MiB)  # no new attempt, no second warning
    assert len(caught) == 1
    assert [c for c, _ in pinner.calls] == ["pin", "failed"]
    assert not pool.pinned and pool.pinned_bytes == MiB and pool.reserved == 3 * MiB
    for k, hb in enumerate((first, second, third)):  # every block holds data
        hb.view.fill_(k + 1)
        assert int(hb.view.sum()) == (k + 1) * MiB
    pool.close()
    assert pinner.pinned == {} and pool.pinned_bytes == 0
    assert [c for c, _ in pinner.calls] == ["pin", "failed", "unpin"]  # only the block that was pinned


class FakeCudart:
    """The CUDA runtime torch links, as ``torch.cuda.cudart()`` returns it (cudaHostRegister and friends)."""

    def __init__(self, fail: int = 0):
        self.registered: dict[int, int] = {}
        self.fail = fail

    def cudaHostRegister(self, addr, nbytes, flags):
        if self.fail:
            return self.fail
        assert flags == 1, "registered portable (cudaHostRegisterPortable), for every context"
        self.registered[addr] = nbytes
        return 0

    def cudaHostUnregister(self, addr):
        return 0 if self.registered.pop(addr, None) is not None else 712  # cudaErrorHostMemoryNotRegistered

    def cudaGetErrorString(self, err):
        return {800: "operation not permitted"}.get(int(err), "unknown error")


def with_torch_cudart(monkeypatch, cudart):
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # no cuda-python: pinning must not need it


def test_blocks_are_pinned_through_torchs_cuda_runtime_without_cuda_python(monkeypatch):
    cudart = FakeCudart()
    with_torch_cudart(monkeypatch, cudart)
    pool = HostPool(pinned=True, block_size=MiB)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no PinningUnavailable
        hb = pool.alloc(4096)
        pool.alloc(2 * MiB)
    assert pool.pinned and pool.pinned_bytes == 3 * MiB == sum(cudart.registered.values())
    assert hb.view.data_ptr() - hb.offset in cudart.registered
    pool.close()
    assert cudart.registered == {} and pool.pinned_bytes == 0


def test_a_refused_registration_warns_with_the_runtimes_reason_and_uses_pageable_memory(monkeypatch):
    with_torch_cudart(monkeypatch, FakeCudart(fail=800))
    pool = HostPool(pinned=True, block_size=MiB)
    with pytest.warns(PinningUnavailable, match="cudaHostRegister.*operation not permitted.*pageable host memory"):
        hb = pool.alloc(4096)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool.alloc(2 * MiB)  # a second block: no second attempt, no second warning
    hb.view.copy_(torch.arange(4096) % 256)
    assert torch.equal(hb.view, (torch.arange(4096) % 256).to(torch.uint8))
    assert pool.pinned_bytes == 0
    pool.close()


def test_without_cuda_the_pool_warns_and_uses_pageable_memory():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    pool = HostPool(pinned=True, block_size=MiB)
    with pytest.warns(PinningUnavailable, match="pageable host memory instead"):
        hb = pool.alloc(4096)
    hb.view.fill_(1)
    assert pool.pinned_bytes == 0 and int(hb.view.sum()) == 4096
    pool.close()
