"""Human units for the screen: bytes in binary units, durations, counts."""
from __future__ import annotations

import time as _time

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40
NA = "n/a"


def fmt_bytes(n: float | None, na: str = NA) -> str:
    """'43.8 GiB', '512 MiB', '-730 MiB'; None -> 'n/a'."""
    if n is None:
        return na
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            v = n / size
            if v < 10:
                return f"{sign}{v:.2f} {unit}"
            if v < 100:
                return f"{sign}{v:.1f} {unit}"
            return f"{sign}{v:.0f} {unit}"
    return f"{sign}{int(n)} B"


def axis_unit(vmax: float) -> tuple[str, float]:
    """The unit an axis up to vmax reads best in."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if vmax >= size:
            return unit, size
    return "B", 1


def nice_step(span: float, n: int) -> float:
    """A round step (1, 2, 2.5, 5 x 10^k ... in the given unit) giving about n intervals."""
    import math
    if span <= 0 or n <= 0:
        return 1.0
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def fmt_duration(s: float | None, na: str = NA) -> str:
    """'12s', '4m05s', '1h02m', '3d04h'."""
    if s is None:
        return na
    s = max(0, int(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def fmt_window(s: float | None) -> str:
    if s is None:
        return "whole run"
    if s < 60:
        return f"{int(s)} s"
    if s < 3600:
        return f"{int(s // 60)} min"
    return f"{s / 3600:g} h"


def fmt_clock(t: float | None) -> str:
    if t is None:
        return NA
    return _time.strftime("%H:%M:%S", _time.localtime(t))


def fmt_ms(s: float | None) -> str:
    if s is None:
        return NA
    ms = s * 1000
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms"


def fmt_us(us: float | None) -> str:
    """A duration in at most 6 columns (136µs, 1.2ms): the figures panel's third column has
    10 cells at 80x24, "cost " included."""
    if us is None:
        return NA
    return f"{us:.0f}µs" if us < 999.5 else f"{us / 1000:.1f}ms"


def fmt_count_short(v: int | None) -> str:
    """A count in at most 6 columns: 9,999 as it is, then 19.3k, 123k, 4.5M."""
    if v is None:
        return NA
    if v < 10_000:
        return f"{v:,}"
    for div, unit in ((1_000_000, "M"), (1_000, "k")):
        if v >= div:
            x = v / div
            return f"{x:.1f}{unit}" if x < 99.95 else f"{x:.0f}{unit}"
    return f"{v:,}"


def hanging(text: str, width: int, indent: str) -> str:
    """text wrapped at width, its continuation lines indented by ``indent`` (Rich wraps a long
    line back to column 0, out from under its item)."""
    import textwrap
    return "\n".join(textwrap.wrap(text, width, subsequent_indent=indent,
                                   break_on_hyphens=False)) or text
