"""The emulated driver keeps the CUDA driver's virtual-memory rules: each broken rule returns the CUresult the
real driver returns, says why in the misuse log, and changes nothing."""

import ctypes

import pytest

from fakecuda.api import (
    CU_MEM_ACCESS_FLAGS_PROT_READ,
    CUDA_ERROR_INVALID_DEVICE,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_SUCCESS,
    CudaError,
    access_desc,
    device_prop,
)

MiB = 1 << 20


def refused(fc, code, reason, name, *args):
    """Calls a driver function that must fail with `code`; checks the misuse log says `reason`."""
    before = len(fc.misuses())
    assert fc.call(name, *args) == code
    log = fc.misuses()
    assert len(log) == before + 1 and reason in log[-1], log[before:]


@pytest.fixture
def g(fakecuda):
    return fakecuda.granularity()


def test_granularity_is_2mib_by_default(fakecuda):
    assert fakecuda.granularity() == 2 * MiB


def test_reservation_size_and_alignment(fakecuda, g):
    out = ctypes.c_ulonglong()
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "multiple of the granularity", "cuMemAddressReserve",
            ctypes.byref(out), g + 4096, 0, 0, 0)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "multiple of the granularity", "cuMemAddressReserve",
            ctypes.byref(out), 0, 0, 0, 0)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "power of two", "cuMemAddressReserve",
            ctypes.byref(out), g, 3 * g, 0, 0)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "flags", "cuMemAddressReserve", ctypes.byref(out), g, 0, 0, 1)
    before = fakecuda.live()["reservations"]
    base = fakecuda.reserve(4 * g, alignment=64 * MiB)
    assert base % (64 * MiB) == 0
    assert fakecuda.live()["reservations"] == before + 1
    fakecuda.free_reservation(base, 4 * g)
    assert fakecuda.live()["reservations"] == before


def test_address_free_needs_the_exact_reservation_and_no_mappings(fakecuda, g):
    base = fakecuda.reserve(4 * g)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "differs from the reserved size", "cuMemAddressFree", base, 2 * g)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "not the start of a reservation", "cuMemAddressFree", base + g, g)
    h = fakecuda.create(g)
    fakecuda.map(base + g, g, h)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "still has mappings", "cuMemAddressFree", base, 4 * g)
    fakecuda.unmap(base + g, g)
    fakecuda.release(h)
    fakecuda.free_reservation(base, 4 * g)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "not the start of a reservation", "cuMemAddressFree", base, 4 * g)


def test_create_checks_size_device_and_total_memory(fakecuda, g):
    h = ctypes.c_ulonglong()
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "multiple of the granularity", "cuMemCreate",
            ctypes.byref(h), g // 2, ctypes.byref(device_prop(0)), 0)
    refused(fakecuda, CUDA_ERROR_INVALID_DEVICE, "device 3 does not exist", "cuMemCreate",
            ctypes.byref(h), g, ctypes.byref(device_prop(3)), 0)
    used = fakecuda.used_bytes()
    refused(fakecuda, CUDA_ERROR_OUT_OF_MEMORY, "bytes free", "cuMemCreate",
            ctypes.byref(h), 8192 * MiB - used + g, ctypes.byref(device_prop(0)), 0)
    handle = fakecuda.create(4 * g)
    assert fakecuda.used_bytes() == used + 4 * g
    fakecuda.release(handle)
    assert fakecuda.used_bytes() == used


def test_map_only_into_reserved_unmapped_ranges_on_granularity(fakecuda, g):
    base = fakecuda.reserve(4 * g)
    h = fakecuda.create(2 * g)
    small = fakecuda.create(g)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "multiple", "cuMemMap", base + 4096, g, 0, small, 0)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "multiple", "cuMemMap", base, g, 4096, h, 0)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "exceeds the allocation", "cuMemMap", base, 2 * g, 0, small, 0)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "exceeds the allocation", "cuMemMap", base, 2 * g, g, h, 0)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "exceeds the allocation", "cuMemMap", base, g, 2 * g, h, 0)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "not inside one reservation", "cuMemMap", base + 3 * g, 2 * g, 0, h, 0)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "not inside one reservation", "cuMemMap", base + 64 * g, g, 0, small, 0)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "never returned by cuMemCreate", "cuMemMap", base, g, 0, 12345, 0)
    fakecuda.map(base + g, 2 * g, h)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "overlaps the mapping", "cuMemMap", base + 2 * g, g, 0, small, 0)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "overlaps the mapping", "cuMemMap", base, 2 * g, 0, h, 0)
    assert fakecuda.live()["mappings"] >= 1
    fakecuda.map(base, g, small)  # the free granule just before the mapping
    fakecuda.release(small)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "was released", "cuMemMap", base + 3 * g, g, 0, small, 0)
    fakecuda.unmap(base, 3 * g)  # two adjacent whole mappings at once
    fakecuda.release(h)
    fakecuda.free_reservation(base, 4 * g)


def test_parts_of_one_allocation_map_at_offsets_and_carry_its_bytes(fakecuda, g):
    """Note [Mapping at an offset]: [offset, offset + size) of the allocation appears at ptr; one allocation
    may be mapped at several places, its parts or the same bytes twice (virtual aliasing)."""
    base = fakecuda.reserve(8 * g)
    h = fakecuda.create(4 * g)
    fakecuda.map(base, 4 * g, h)  # the whole allocation, to write each granule's own tag
    fakecuda.set_access(base, 4 * g)
    for i in range(4):
        fakecuda.poke(base + i * g, bytes([65 + i]) * 8)
    fakecuda.unmap(base, 4 * g)
    fakecuda.map(base + 4 * g, 2 * g, h, offset=2 * g)  # granules 2 and 3, then 0 after them
    fakecuda.map(base + 6 * g, g, h, offset=0)
    fakecuda.map(base, g, h, offset=2 * g)  # granule 2 a second time: an alias
    assert fakecuda.live()["mappings"] >= 3
    fakecuda.set_access(base + 4 * g, 3 * g)  # a run of two mappings of one allocation
    fakecuda.set_access(base, g)
    assert [fakecuda.peek(base + (4 + i) * g, 8) for i in range(3)] == [b"C" * 8, b"D" * 8, b"A" * 8]
    fakecuda.poke(base + 4 * g, b"written")  # through one alias, seen through the other
    assert fakecuda.peek(base, 7) == b"written"
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "ends inside the mapping", "cuMemUnmap", base + 4 * g, g)
    fakecuda.unmap(base + 4 * g, 2 * g)
    fakecuda.unmap(base + 6 * g, g)
    fakecuda.unmap(base, g)
    fakecuda.release(h)
    fakecuda.free_reservation(base, 8 * g)


def test_a_released_allocation_lives_until_its_last_mapping_goes(fakecuda, g):
    used, allocations = fakecuda.used_bytes(), fakecuda.live()["allocations"]
    base = fakecuda.reserve(4 * g)
    h = fakecuda.create(2 * g)
    fakecuda.map(base, g, h, offset=g)
    fakecuda.map(base + 2 * g, g, h, offset=0)
    fakecuda.set_access(base, g)
    fakecuda.release(h)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "was released", "cuMemMap", base + 3 * g, g, 0, h, 0)
    fakecuda.poke(base, b"alive")
    fakecuda.unmap(base, g)
    assert fakecuda.used_bytes() == used + 2 * g  # one mapping is left
    fakecuda.unmap(base + 2 * g, g)
    assert fakecuda.used_bytes() == used and fakecuda.live()["allocations"] == allocations
    fakecuda.free_reservation(base, 4 * g)


def test_offsets_can_be_refused_as_cuda_h_says_currently():
    from fakecuda.isolated import run_isolated

    proc = run_isolated("""
        import fakecuda
        from fakecuda.api import CUDA_ERROR_INVALID_VALUE
        fc = fakecuda.driver()
        g = fc.granularity()
        base, h = fc.reserve(2 * g), fc.create(2 * g)
        assert fc.call("cuMemMap", base, g, g, h, 0) == CUDA_ERROR_INVALID_VALUE
        assert "currently must be zero" in fc.misuses()[-1]
        fc.map(base, 2 * g, h)  # offset 0 still maps
        print("refused")
    """, FAKECUDA_MAP_OFFSETS="0")
    assert proc.returncode == 0 and "refused" in proc.stdout, proc.stderr


def test_memory_is_inaccessible_until_set_access(fakecuda, g):
    base = fakecuda.reserve(2 * g)
    h = fakecuda.create(g)
    fakecuda.map(base, g, h)
    assert fakecuda.access_flags(base) == 0
    fakecuda.set_access(base, g, flags=CU_MEM_ACCESS_FLAGS_PROT_READ)
    assert fakecuda.peek(base, 4) == b"\0\0\0\0"
    fakecuda.set_access(base, g)
    assert fakecuda.access_flags(base) == 3
    fakecuda.poke(base, b"data")
    assert fakecuda.peek(base, 4) == b"data"
    fakecuda.unmap(base, g)
    fakecuda.release(h)
    fakecuda.free_reservation(base, 2 * g)


def test_touching_memory_before_set_access_faults_as_on_a_gpu():
    from fakecuda.isolated import run_isolated

    proc = run_isolated("""
        import fakecuda
        fc = fakecuda.driver()
        g = fc.granularity()
        base = fc.reserve(g)
        fc.map(base, g, fc.create(g))
        print("mapped", flush=True)
        fc.peek(base, 1)
        print("read without access")
    """)
    assert "mapped" in proc.stdout and "read without access" not in proc.stdout
    assert proc.returncode == -11 or "AddressSanitizer: SEGV" in proc.stderr  # SIGSEGV (reported by ASan)


def test_set_access_only_on_fully_mapped_whole_mappings(fakecuda, g):
    base = fakecuda.reserve(4 * g)
    a, b = fakecuda.create(g), fakecuda.create(2 * g)
    fakecuda.map(base, g, a)
    fakecuda.map(base + g, 2 * g, b)
    rw = access_desc(0)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "is not mapped at", "cuMemSetAccess", base, 4 * g, ctypes.byref(rw), 1)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "ends inside the mapping", "cuMemSetAccess",
            base, 2 * g, ctypes.byref(rw), 1)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "inside the mapping", "cuMemSetAccess",
            base + 2 * g, g, ctypes.byref(rw), 1)
    refused(fakecuda, CUDA_ERROR_INVALID_DEVICE, "device 7", "cuMemSetAccess", base, g,
            ctypes.byref(access_desc(7)), 1)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "no access descriptors", "cuMemSetAccess", base, g, None, 0)
    fakecuda.set_access(base, 3 * g)  # a run of two mappings
    fakecuda.poke(base + 3 * g - 1, b"x")
    fakecuda.unmap(base, 3 * g)
    fakecuda.release(a)
    fakecuda.release(b)
    fakecuda.free_reservation(base, 4 * g)


def test_unmap_only_whole_mappings(fakecuda, g):
    base = fakecuda.reserve(4 * g)
    h = fakecuda.create(2 * g)
    fakecuda.map(base, 2 * g, h)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "ends inside the mapping", "cuMemUnmap", base, g)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "inside the mapping", "cuMemUnmap", base + g, g)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "is not mapped at", "cuMemUnmap", base, 3 * g)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "is not mapped at", "cuMemUnmap", base + 2 * g, g)
    assert fakecuda.live()["mappings"] >= 1
    fakecuda.unmap(base, 2 * g)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "is not mapped at", "cuMemUnmap", base, 2 * g)
    fakecuda.release(h)
    fakecuda.free_reservation(base, 4 * g)


def test_an_allocation_carries_its_bytes_to_a_new_address(fakecuda, g):
    base = fakecuda.reserve(4 * g)
    h = fakecuda.create(g)
    fakecuda.map(base, g, h)
    fakecuda.set_access(base, g)
    fakecuda.poke(base + 100, b"kept")
    fakecuda.unmap(base, g)
    fakecuda.map(base + 3 * g, g, h)
    fakecuda.set_access(base + 3 * g, g)  # a new mapping starts without access
    assert fakecuda.peek(base + 3 * g + 100, 4) == b"kept"
    fakecuda.unmap(base + 3 * g, g)
    fakecuda.release(h)
    fakecuda.free_reservation(base, 4 * g)


def test_release_while_mapped_frees_at_the_last_unmap(fakecuda, g):
    used = fakecuda.used_bytes()
    allocations = fakecuda.live()["allocations"]
    base = fakecuda.reserve(2 * g)
    h = fakecuda.create(g)
    fakecuda.map(base, g, h)
    fakecuda.set_access(base, g)
    fakecuda.release(h)  # allowed: the memory lives while it is mapped
    fakecuda.poke(base, b"still here")
    assert fakecuda.peek(base, 10) == b"still here"
    assert fakecuda.used_bytes() == used + g
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "already released", "cuMemRelease", h)
    fakecuda.unmap(base, g)
    assert fakecuda.used_bytes() == used and fakecuda.live()["allocations"] == allocations
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "already released", "cuMemRelease", h)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "never returned by cuMemCreate", "cuMemRelease", 7)
    fakecuda.free_reservation(base, 2 * g)


def test_errors_raise_with_the_reason(fakecuda, g):
    with pytest.raises(CudaError, match=r"cuMemUnmap returned CUDA_ERROR_INVALID_VALUE \(1\): .*not mapped"):
        fakecuda.unmap(fakecuda.reserve(g), g)


def test_pointer_attributes(fakecuda, g):
    base = fakecuda.reserve(2 * g)
    h = fakecuda.create(2 * g)
    fakecuda.map(base, 2 * g, h)
    ordinal, start, size = ctypes.c_int(-1), ctypes.c_ulonglong(), ctypes.c_size_t()
    assert fakecuda.call("cuPointerGetAttribute", ctypes.byref(ordinal), 9, base + 5) == CUDA_SUCCESS
    assert fakecuda.call("cuPointerGetAttribute", ctypes.byref(start), 11, base + 5) == CUDA_SUCCESS
    assert fakecuda.call("cuPointerGetAttribute", ctypes.byref(size), 12, base + 5) == CUDA_SUCCESS
    assert (ordinal.value, start.value, size.value) == (0, base, 2 * g)
    fakecuda.unmap(base, 2 * g)
    refused(fakecuda, CUDA_ERROR_INVALID_VALUE, "not mapped", "cuPointerGetAttribute", ctypes.byref(ordinal), 9, base)
    fakecuda.release(h)
    fakecuda.free_reservation(base, 2 * g)
