"""Reading and writing sizes: memory (``80GB``, ``80GiB``), bandwidth and counts."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str, default_unit: str = "G") -> float:
    """Bytes in ``text``: ``80GB`` (decimal, 80e9), ``80GiB`` (binary, 80 x 2**30), ``24576MiB``.

    A bare number is read in ``default_unit`` (decimal). Raises ValueError with the fix
    for anything else, including zero or negative sizes.
    """
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(
            f"'{text}' is not a size; write a number with a unit such as 80GB, 80GiB, 141GB or "
            f"24576MiB (GB = 10^9 bytes, GiB = 2^30 bytes; a bare number means {default_unit}B)"
        )
    number, prefix, binary, _ = match.groups()
    prefix = prefix.lower() if prefix else ("" if binary or _ else default_unit.lower())
    if binary and not prefix:
        raise ValueError(f"'{text}' is not a size: 'i' needs a prefix as in GiB or MiB")
    value = float(number) * (1024 if binary else 1000) ** _POWERS[prefix]
    if value <= 0:
        raise ValueError(f"size '{text}' must be larger than zero")
    return value


_COUNT = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e\d+)?|\.\d+)\s*([kmbt]?)\s*$", re.IGNORECASE)
_COUNT_SCALES = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """A count such as ``300M``, ``10B``, ``2T`` or ``1e9`` (as ``fmt_count`` writes them).
    Raises ValueError with the fix for anything else, zero included."""
    match = _COUNT.match(str(text))
    value = float(match.group(1)) * _COUNT_SCALES[match.group(2).lower()] if match else 0.0
    if value <= 0:
        raise ValueError(f"'{text}' is not a count above zero; write it like 300M, 10B, 2T or 1e9")
    return value


def fmt_bytes(value: float) -> str:
    """Decimal bytes with three significant figures: ``1.23 GB``, ``512 MB``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def fmt_count(value: float) -> str:
    """Counts with a suffix: ``124M``, ``1.3B``, ``7.1k``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.4g}{unit}"
    return f"{value:.4g}"


def fmt_seconds(value: float) -> str:
    """Times from microseconds to hours in the most readable unit."""
    if value >= 3600:
        return f"{value / 3600:.2f} h"
    if value >= 1:
        return f"{value:.3g} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} us"
