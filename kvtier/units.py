"""Byte-size parsing and formatting ("4GiB" <-> 4294967296)."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")

KiB = 1024
MiB = 1024**2
GiB = 1024**3


def parse_size(value: str | int | float) -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"4GiB"`` or ``"1.5GB"``.

    Raises:
        ValueError: the string is not a size.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    m = _SIZE_RE.match(value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{value!r} is not a size like 4096, '512MiB' or '4GiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: float) -> str:
    """Human-readable binary size: ``format_size(3 * 2**30) == '3.00 GiB'``."""
    for unit, div in (("TiB", 1024**4), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align
