"""Memory sizes as people write them: ``24GB``, ``80 GiB``, ``512MB`` (``--gpu-memory``).

Decimal units are powers of 1000 (GB = 1e9 bytes), binary ones powers of 1024
(GiB = 2^30 bytes); unit letters are case-insensitive. A GPU sold as "24 GB" has 24 GiB
(25.8e9 bytes): ``24GB`` leaves ~1.8 GB of it for the CUDA context and fragmentation.
"""

from __future__ import annotations

import math
import re

__all__ = ["UNITS", "format_budget", "format_size", "parse_size", "size_unit"]

#: bytes per unit, by its lower-case name
UNITS = {
    "b": 1,
    **{f"{p}b": 1000**i for i, p in enumerate("kmgt", 1)},
    **{f"{p}ib": 1024**i for i, p in enumerate("kmgt", 1)},
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)
_SPELLING = {u: u[0].upper() + u[1:].replace("b", "B") for u in UNITS}  # gib → GiB


def parse_size(text: str, name: str = "--gpu-memory") -> int:
    """Bytes of ``text``: a positive number and a unit (B, KB, MB, GB, TB, KiB, MiB, GiB,
    TiB); ``ValueError`` naming ``name`` and what is allowed otherwise."""
    allowed = ", ".join(_SPELLING[u] for u in UNITS)
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{name} must be a size such as 24GB or 80GiB (units: {allowed}); "
                         f"got {text!r}")  # fmt: skip
    number, unit = float(match.group(1)), match.group(2).lower()
    if not unit:
        raise ValueError(f"{name} {text!r} needs a unit ({allowed}), e.g. 24GB")
    if unit not in UNITS:
        raise ValueError(f"{name} {text!r}: unknown unit {match.group(2)!r}; units: {allowed}")
    size = number * UNITS[unit]
    if not math.isfinite(size) or size < 1:
        raise ValueError(f"{name} must be at least 1 byte, got {text!r}")
    return int(size)


def size_unit(text: str) -> str:
    """The unit ``text`` is written in, spelled canonically (``24gib`` → ``GiB``); call it
    on a size :func:`parse_size` accepted."""
    match = _SIZE.fullmatch(text)
    if match is None or match.group(2).lower() not in UNITS:
        raise ValueError(f"not a size with a unit: {text!r}")
    return _SPELLING[match.group(2).lower()]


def format_size(n: int, unit: str = "GB", digits: int = 2) -> str:
    """``n`` bytes in ``unit`` (a key of :data:`UNITS`, any case), without the unit name."""
    return f"{n / UNITS[unit.lower()]:.{digits}f}"


def format_budget(n: int, unit: str = "GB") -> str:
    """A budget of ``n`` bytes in ``unit`` as it was written: ``1.5`` for 1.5 GB, ``24``
    for 24 GB — never rounded to another figure (up to 6 significant digits)."""
    return f"{n / UNITS[unit.lower()]:.6g}"
