"""LiveBytesMeter follows storages that are resized in place (Note [Storages that resize]): FSDP2 frees an
all-gathered parameter with ``untyped_storage().resize_(0)`` and allocates it again with ``resize_(n)``."""

import torch

import swap


def test_a_storage_resized_in_place_counts_its_new_size():
    with swap.LiveBytesMeter("cpu") as meter:
        t = torch.empty(1024)  # 4 KiB, counted when made
        assert meter.live == 4096
        t.untyped_storage().resize_(0)
        assert meter.live == 0
        t.untyped_storage().resize_(8192)
        assert meter.live == 8192 and meter.peak == 8192
        del t
        assert meter.live == 0


def test_a_storage_not_counted_yet_is_counted_when_it_grows_and_resize_is_restored_on_exit():
    plain = torch.UntypedStorage.resize_
    outside = torch.empty(0)  # made before the meter: not counted
    with swap.LiveBytesMeter("cpu") as meter:
        with swap.LiveBytesMeter("cpu") as inner:  # meters nest: both see the resize
            outside.untyped_storage().resize_(400)
        assert meter.live == inner.peak == 400
    assert torch.UntypedStorage.resize_ is plain
