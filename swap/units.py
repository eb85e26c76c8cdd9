"""Sizes in bytes, read and written in one place: ``parse_size`` reads what a user gives (an int, or a string
such as ``"12GiB"``) for the API and the command line alike, and the formatters write sizes back for messages,
tables and command lines (``size_arg`` writes one that ``parse_size`` reads back).

The bottom room of swap/: it imports nothing of swap, nor vmalloc.

Note [Size strings]
A size is a number of bytes (an int, or digits) or a number and a unit: ``"12GiB"``, ``"1.5GiB"``, ``"4.8MiB"``,
``"10MB"``, ``"12gb"``. Units are read without regard to case. Binary units are powers of 1024: KiB, MiB, GiB, TiB,
and their one-letter forms K, M, G, T; decimal units are powers of 1000: KB (kB), MB, GB, TB, so ``"12gb"`` is
``"12GB"``, 12e9 bytes, as the allocator (``vmalloc.parse_size``) reads "12GB". Every form vmalloc reads gives the
same bytes here (tests/plan/test_units.py checks), and more is accepted: any case, and a decimal value whose bytes
are not whole (``"4.8MiB"``), rounded down to a whole byte (a budget rounded down is never more than was asked).
The API and the command line read sizes with this one function.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Optional, Union

Size = Union[int, str, None]

SIZE_FORMS = ("a number of bytes or a size string such as '12GiB', '512MiB', '1.5GiB' or '10GB' (units KiB, MiB, "
              "GiB, TiB or K, M, G, T: powers of 1024; KB, MB, GB, TB: powers of 1000; any case)")
UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
         "t": 1 << 40, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}  # Note [Size strings]
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)")
LIMIT = 1 << 63  # the allocator's counters are int64


def size_bytes(text: str) -> int:
    """The bytes of a size string (Note [Size strings]); a ValueError saying why not."""
    m = _SIZE.fullmatch(text.strip().lower())
    if m is None or m.group(2) not in UNITS:
        raise ValueError(f"invalid size {text!r}")
    n = math.floor(Fraction(m.group(1)) * UNITS[m.group(2)])
    if n >= LIMIT:
        raise ValueError(f"invalid size {text!r}: too large (sizes must be below 2^63 bytes)")
    return n


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
        text = value.strip()
        try:  # "-1GiB" is a size, refused below as negative, not a string that is no size
            n = -size_bytes(text[1:]) if text.startswith("-") else size_bytes(text)
        except ValueError as e:
            why = "too large" if "too large" in str(e) else "invalid size"
            raise ValueError(f"{what} must be {forms}, not {value!r} ({why})") from None
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
