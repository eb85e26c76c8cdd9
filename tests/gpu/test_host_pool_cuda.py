"""The swap host pool on CUDA: its blocks are page-locked exactly (through torch's CUDA runtime; checked with
the driver through cuda-python), unpinned at close, and copies from them overlap compute."""

import torch

from swap.runtime.machine.host_pool import HostPool

from cuda_oracle import pinned_host

MiB = 1 << 20


def test_blocks_are_pinned_exactly_and_unpinned_at_close():
    pool = HostPool(pinned=True, block_size=64 * MiB + 512)
    a, b = pool.alloc(10 * MiB), pool.alloc(70 * MiB)  # the second needs its own, larger block
    assert pool.pinned_bytes == pool.reserved == (64 * MiB + 512) + 70 * MiB
    for hb in (a, b):
        assert hb.view.is_pinned(), "torch must see the pool's memory as pinned"
        assert pinned_host(hb.view.data_ptr())
        assert pinned_host(hb.view.data_ptr() + hb.nbytes - 1)
    ptr = a.view.data_ptr()
    pool.close()
    assert pool.pinned_bytes == 0
    assert not pinned_host(ptr), "close() must unpin every block"


def test_copies_from_the_pool_overlap_compute():
    pool = HostPool(pinned=True, block_size=512 * MiB)
    hb = pool.alloc(256 * MiB)
    hb.view.fill_(1)
    dst = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    a = torch.randn(4096, 4096, device="cuda")
    copy_stream = torch.cuda.Stream()

    def timed(fn) -> float:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    reps = [1]

    def compute():
        for _ in range(reps[0]):
            a @ a

    def copy():
        with torch.cuda.stream(copy_stream):
            dst.copy_(hb.view, non_blocking=True)
        torch.cuda.current_stream().wait_stream(copy_stream)

    def both():
        with torch.cuda.stream(copy_stream):
            dst.copy_(hb.view, non_blocking=True)
        compute()
        torch.cuda.current_stream().wait_stream(copy_stream)

    compute(), copy()  # warm up
    t_copy, t_one = timed(copy), timed(compute)
    reps[0] = max(1, round(t_copy / t_one))  # compute about as long as the copy: overlap then halves the sum
    t_compute, t_copy, t_both = timed(compute), timed(copy), timed(both)
    assert t_both < 0.8 * (t_compute + t_copy), (t_compute, t_copy, t_both)
    assert bool((dst == 1).all())
    pool.close()
