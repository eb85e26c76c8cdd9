"""``swap.units.parse_size``, the one size reader of the API and the command line (Note [Size strings]): every form
the allocator reads gives the same bytes, and the forms a user writes beside them ("4.8MiB", "12gb") are read too,
in ``SwapManager`` and in ``python -m swap.plan`` alike."""

import pytest

import swap
import vmalloc
from swap.units import parse_size


@pytest.mark.parametrize("text", ["4096", "512KiB", "2MiB", "1.5GiB", "10MB", "12GB", "12G", "3T", "1kB", "0", "7 MiB"])
def test_every_form_the_allocator_reads_gives_its_bytes(text):
    assert parse_size(text, "budget") == vmalloc.parse_size(text)


@pytest.mark.parametrize("text, expected", [
    ("4.8MiB", 5033164),  # 4.8 x 2^20 = 5033164.8 bytes: rounded down (was refused: not whole bytes)
    ("12gb", 12 * 10**9),  # a decimal unit in any case (was refused: invalid size unit)
    ("12gib", 12 << 30),
    ("1.5gib", 3 << 29),
    ("2mb", 2 * 10**6),
    ("0.5k", 512),
])  # fmt: skip
def test_decimal_values_and_any_case_are_read(text, expected):
    assert parse_size(text, "budget") == expected


@pytest.mark.parametrize("text", ["1e3", "12 parsecs", ".5G", "1.", "1..2GiB", "GiB"])
def test_what_is_no_size_is_refused_naming_the_units_accepted(text):
    with pytest.raises(ValueError) as e:
        parse_size(text, "--budget")
    assert f"not {text!r} (invalid size)" in str(e.value)
    assert "KB, MB, GB, TB: powers of 1000; any case" in str(e.value)


def test_the_manager_and_the_command_line_read_the_same_forms(monkeypatch, capsys):
    sm = swap.SwapManager(budget="12gb", min_bytes="4.8MiB", device="cpu")
    assert (sm.budget, sm.min_bytes) == (12 * 10**9, 5033164)
    from swap import cli

    asked = {}

    def record(*_a, **kwargs):
        asked.update(kwargs)
        raise ValueError("planning stopped by the test")

    monkeypatch.setattr(cli, "plan", record)
    assert cli.main(["--model", "unet", "--size", "64", "--budget", "1.5gb", "--min-bytes", "4.8MiB"]) == 2
    assert "planning stopped by the test" in capsys.readouterr().err  # read, not refused by argparse
    assert (asked["budget"], asked["min_bytes"]) == ("1.5gb", "4.8MiB")
