"""Number formatting shared by the diagnosis, the timeline and the compare report."""

from __future__ import annotations

import math


def s(v: float | None, digits: int = 3) -> str:
    """Seconds, shown in ms below 1 s."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if abs(v) < 1.0:
        return f"{v * 1e3:.{max(0, digits - 2) if abs(v) >= 0.1 else 1}f} ms"
    return f"{v:.{max(1, digits - 1)}f} s"


def ms(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{v * 1e3:.{digits}f}"


def pct(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{v * 100:.{digits}f}%"


def nbytes(v: float | None) -> str:
    if v is None:
        return "—"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.2f} {unit}"
    return f"{v:.0f} B"


def rate(v: float | None, unit: str = "B/s") -> str:
    if v is None or math.isinf(v):
        return "—"
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.2f} {prefix}{unit}"
    return f"{v:.1f} {unit}"


def num(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"
