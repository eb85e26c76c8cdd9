"""Strict parsing of sizes, booleans, devices and VMALLOC_CONF, with errors that say what to write instead;
capacity and size overflow are rejected before they can wrap."""

import pytest

import vmalloc
from vmalloc import _C

KiB, MiB, GiB = 1024, 1024**2, 1024**3


@pytest.mark.parametrize(
    "text, value",
    [("4096", 4096), ("512KiB", 512 * KiB), ("1.5GiB", 3 * GiB // 2), ("10MB", 10_000_000), (" 2 MiB ", 2 * MiB),
     ("9223372036854775807", 2**63 - 1)],
)
def test_sizes_that_parse(text, value):
    assert vmalloc.parse_size(text) == value


@pytest.mark.parametrize(
    "text, message",
    [
        ("1..2GiB", "expected a byte count"),
        ("1.2.3", "expected a byte count"),
        ("1.", "expected a byte count"),
        ("-5", "must not be negative"),
        ("-1GiB", "must not be negative"),
        ("12 parsecs", "invalid size unit"),
        ("", "expected a byte count"),
        ("99999999999999999999", "too large"),
        ("9223372036854775808", "too large"),
        ("9000000TiB", "too large"),
        ("0.5", "not a whole number of bytes"),
    ],
)
def test_bad_sizes_are_rejected_with_the_accepted_forms(text, message):
    with pytest.raises(ValueError, match=message):
        vmalloc.parse_size(text)


def test_capacity_beyond_any_device_is_rejected_not_wrapped():
    for capacity in ("9000000TB", 2**62, "2048TiB"):
        with pytest.raises(ValueError, match="more than vmalloc supports"):
            vmalloc.Arena("sim", capacity=capacity)
    with pytest.raises(ValueError, match="more than vmalloc supports"):
        _C.parse_conf("capacity=9000000TB")
    # The largest accepted capacity reserves 4x of it without overflow.
    a = vmalloc.Arena("sim", capacity="1024TiB")
    a.free(a.malloc(3 * MiB))
    assert a.stats()["va_reserved_bytes"] > 0


def test_malloc_of_an_impossible_size_names_it():
    a = vmalloc.Arena("host", capacity="1MiB", chunk_size="64KiB", small_max="16KiB")
    with pytest.raises(vmalloc.OutOfMemoryError, match=r"18446744073709551615 bytes, more than the whole capacity"):
        a.malloc(2**64 - 1)
    with pytest.raises(ValueError, match="must not be negative"):
        a.malloc(-1)
    with pytest.raises(ValueError, match="does not fit in 64 bits"):
        a.malloc(2**64)
    a.check_invariants()
    assert a.stats()["allocation.all.current"] == 0


@pytest.mark.parametrize("text", ["1", "true", "True", "yes", "on", "YES"])
def test_true_booleans(text):
    assert _C.parse_conf(f"eager_growth={text}")["eager_growth"] is True


@pytest.mark.parametrize("text", ["0", "false", "False", "no", "off"])
def test_false_booleans(text):
    assert _C.parse_conf(f"eager_growth={text}")["eager_growth"] is False


def test_bad_boolean_lists_the_accepted_forms():
    with pytest.raises(ValueError, match="write true or false .*yes/no"):
        _C.parse_conf("eager_growth=maybe")


@pytest.mark.parametrize(
    "conf, message",
    [
        ("device=x", "invalid VMALLOC_CONF device 'x': write a non-negative whole number"),
        ("device=-1", "invalid VMALLOC_CONF device"),
        ("device=1.5", "invalid VMALLOC_CONF device"),
        ("devices=0", "devices must be between 1 and 64"),
        ("devices=65", "at most 64"),
        ("history=lots", "invalid VMALLOC_CONF history"),
        ("backend=tpu", "choose 'cuda', 'host' or 'sim'"),
        ("chunk_size=1MiB,small_max=2MiB", "must not exceed chunk_size"),
        ("capacity", "is not key=value"),
        ("chunk_sz=2MiB", "known keys are"),
    ],
)
def test_bad_conf_items_say_what_to_write(conf, message):
    with pytest.raises(ValueError, match=message):
        _C.parse_conf(conf)


def test_conf_keys_parse():
    c = _C.parse_conf("backend=host, capacity=1GiB ,chunk_size=64KiB,small_max=16KiB,history=100,devices=2,device=1,"
                      "block_size=1MiB")
    assert c == {
        "backend": "host", "capacity": GiB, "chunk_size": 64 * KiB, "small_max": 16 * KiB, "history": 100,
        "devices": 2, "device": 1, "eager_growth": False, "block_size": MiB, "growth_slack": 0.0, "mid_chunks": 0,
        "step_plan": True,
    }


def test_block_size_must_be_a_multiple_of_the_chunk_size():
    with pytest.raises(ValueError, match="block_size 96.00 KiB is not a multiple of chunk_size"):
        _C.parse_conf("chunk_size=64KiB,small_max=16KiB,block_size=96KiB")
    with pytest.raises(ValueError, match="block_size 32.00 KiB is not a multiple of chunk_size"):
        vmalloc.Arena("host", capacity="1MiB", chunk_size="64KiB", small_max="16KiB", block_size="32KiB")
    a = vmalloc.Arena("host", capacity="1MiB", chunk_size="64KiB", small_max="16KiB", block_size="256KiB")
    assert a.stats()["block_size"] == 256 * KiB and a.config["block_size"] == 256 * KiB
    assert vmalloc.Arena("sim").stats()["block_size"] == 32 * MiB  # the default


def test_device_is_checked_against_the_device_count():
    with pytest.raises(ValueError, match="device 1 does not exist: the host backend presents 1 device"):
        vmalloc.Arena("host", device=1)
    a = vmalloc.Arena("host", device=1, devices=2, capacity="1MiB", chunk_size="64KiB", small_max="16KiB")
    assert a.device == 1
    with pytest.raises(ValueError, match="device -1 does not exist"):
        vmalloc.Arena("sim", device=-1)
