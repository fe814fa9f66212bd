"""Byte sizes: parse "80GiB" / "80GB" / "512 MiB", print human units.

A size always carries its unit: `--gpu 80` once meant 80 bytes, and `--fit` then said "even
batch 1 does not fit 80 B". A bare number (other than 0) and the ambiguous one-letter units
("80G": GB or GiB?) are refused with a line that suggests both spellings.
"""
from __future__ import annotations

import re

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
GiB = 2**30
MiB = 2**20


class SizeError(ValueError):
    """A size without a unit, or not a size at all (one clear line)."""


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    """'80GiB' -> 85899345920; '80GB' -> 80e9; '0' -> 0. A bare number or '80G' is an error."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m:
        raise SizeError(f"{what} {text!r} is not a size (try 80GiB or 80GB)")
    num, unit = m.group(1), m.group(2).lower()
    if not unit:
        if float(num) == 0:
            return 0
        raise SizeError(f"{what} {text!r} has no unit: say {num}GiB (2^30 bytes) or {num}GB (10^9 bytes)"
                        f"{', or ' + num + 'B for bytes' if float(num) >= 1e6 else ''}")
    if unit in ("k", "m", "g", "t"):
        u = unit.upper()
        raise SizeError(f"{what} {text!r} is ambiguous: say {num}{u}iB (binary) or {num}{u}B (decimal)")
    if unit not in _UNITS:
        raise SizeError(f"{what} {text!r}: unknown unit {m.group(2)!r} (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    value = float(num) * _UNITS[unit]
    if not value < 2**60:      # 1e400GiB is inf; no device holds an exbibyte
        raise SizeError(f"{what} {text!r} is not a size any device has")
    return int(value)


def parse_count(text: str | int | float) -> int:
    """'1.5e9', '1.5B', '350M', '7b' -> an integer count."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*", text)
    if not m:
        raise ValueError(f"not a count: {text!r} (try 1.5e9, 1.5B or 350M)")
    mult = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}[m.group(2).lower()]
    value = float(m.group(1)) * mult
    if not value < 1e18:       # 1e400 is inf: int(inf) raised OverflowError (a traceback)
        raise ValueError(f"{text!r} is past any model's size")
    return int(round(value))


def fmt_bytes(n: float) -> str:
    """Binary units, three significant figures: '43.8 GiB', '512 MiB'."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit, size in (("TiB", 2**40), ("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if n >= size:
            v = n / size
            return f"{sign}{v:.3g} {unit}" if v < 100 else f"{sign}{v:.0f} {unit}"
    return f"{sign}{int(n)} B"
