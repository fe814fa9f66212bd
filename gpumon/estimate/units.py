"""Byte sizes: parse "80GiB" / "80GB" / "1.5e9", print human units."""
from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
GiB = 2**30
MiB = 2**20


def parse_bytes(text: str | int | float) -> int:
    """'80GiB' -> 85899345920; '80GB' -> 80e9; a bare number is bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (try 80GiB, 80GB or a number of bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_count(text: str | int | float) -> int:
    """'1.5e9', '1.5B', '350M', '7b' -> an integer count."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*", text)
    if not m:
        raise ValueError(f"not a count: {text!r} (try 1.5e9, 1.5B or 350M)")
    mult = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}[m.group(2).lower()]
    return int(round(float(m.group(1)) * mult))


def fmt_bytes(n: float) -> str:
    """Binary units, three significant figures: '43.8 GiB', '512 MiB'."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit, size in (("TiB", 2**40), ("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if n >= size:
            v = n / size
            return f"{sign}{v:.3g} {unit}" if v < 100 else f"{sign}{v:.0f} {unit}"
    return f"{sign}{int(n)} B"
