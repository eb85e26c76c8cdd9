"""Sizes in bytes, read and written in one place: ``parse_size`` reads what a user gives (an int, or a string
such as ``"12GiB"``) for the API and the command line alike, and the formatters write sizes back for messages,
tables and command lines (``size_arg`` writes one that ``parse_size`` reads back).

The bottom room of swap/: it imports nothing of swap, and vmalloc only for its size grammar (``vmalloc.parse_size``),
so "12GiB" means the same bytes to the allocator and to swap.
"""

from __future__ import annotations

from typing import Optional, Union

Size = Union[int, str, None]

SIZE_FORMS = "a number of bytes or a size string such as '12GiB', '512MiB', '1.5GiB'"


def parse_size(value: Size, what: str, *, minimum: int = 0, none: str = "") -> Optional[int]:
    """An int or a size string as bytes (None stays None when ``none`` says what None means).

    ``what`` names the argument in messages (``"budget"``, ``"--budget"``); a value below ``minimum`` bytes is
    refused with a ValueError, a value of another type with a TypeError, each saying the forms accepted.
    """
    forms = SIZE_FORMS + (f", or None ({none})" if none else "")
    if value is None:
        if none:
            return None
        raise TypeError(f"{what} must be {forms}, not None")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{what} must be {forms}, not {value!r} ({type(value).__name__})")
    if isinstance(value, int):
        n = value
    else:
        from vmalloc import parse_size as vparse

        text = value.strip()
        try:  # "-1GiB" is a size, refused below as negative, not a string that is no size
            n = -vparse(text[1:]) if text.startswith("-") else vparse(text)
        except ValueError:
            raise ValueError(f"{what} must be {forms}, not {value!r} (invalid size)") from None
    if n < 0:
        raise ValueError(f"{what} must not be negative (got {value!r})")
    if n < minimum:
        raise ValueError(f"{what} must be at least {minimum} byte{'s' if minimum != 1 else ''} (got {value!r})"
                         + (f"; None means {none}" if none else ""))  # fmt: skip
    return n


def fmt_bytes(n: int) -> str:
    """1.50 MiB, 3.00 GiB, 512 B."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def fmt_size(n: Optional[int]) -> str:
    """``fmt_bytes``, and "-" for None (a figure that does not exist), for tables."""
    return "-" if n is None else fmt_bytes(n)


def fmt_exact(n: int) -> str:
    """A size a user can paste back: ``68.18 MiB (71494812 bytes)``."""
    return f"{fmt_bytes(n)} ({n} bytes)" if abs(n) >= 1024 else f"{n} bytes"


def size_arg(n: int) -> str:
    """A size string the parsers take back, at most ``n``: whole GiB when exact (``16GiB``), else whole MiB,
    KiB or bytes, rounded down (``16127MiB``): parsers refuse sizes that are not whole bytes."""
    if n >= 1 << 30 and n % (1 << 30) == 0:
        return f"{n >> 30}GiB"
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift}{unit}"
    return str(n)
