"""Byte sizes on the command line: ``4KiB``, ``16MiB``, ``1GiB``, ``64KB``, ``4096``."""

from __future__ import annotations

import re

from omnilink._errors import ConfigurationError

__all__ = ["format_size", "parse_size", "parse_sizes"]

# Binary and decimal units are both accepted because users type both; the suffix decides.
_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
#: Sizes are bf16 tensors of ``size // 2`` elements; larger than this is refused so a
#: typo (``256GiB``) fails fast instead of exhausting memory.
MAX_SIZE = 8 << 30


def parse_size(text: str) -> int:
    """Parse one size such as ``"4KiB"`` (binary) or ``"64KB"`` (decimal) into bytes.

    Raises
    ------
    ConfigurationError
        Not a size, an unknown unit, not a positive even number of bytes, or above 8 GiB.
    """
    m = _SIZE_RE.fullmatch(text)
    if m is None:
        raise ConfigurationError(f"invalid size {text!r}: expected e.g. 4KiB, 16MiB, 1GiB, 64KB or 4096")
    number, unit = m.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ConfigurationError(
            f"invalid size {text!r}: unknown unit {unit!r} (use B, KiB, MiB, GiB, KB, MB or GB)"
        )
    value = float(number) * factor
    if value != int(value):
        raise ConfigurationError(f"invalid size {text!r}: not a whole number of bytes")
    n = int(value)
    if n < 2 or n % 2:
        raise ConfigurationError(f"invalid size {text!r}: payloads are bf16, need an even size >= 2 bytes")
    if n > MAX_SIZE:
        raise ConfigurationError(f"invalid size {text!r}: larger than the 8 GiB limit")
    return n


def parse_sizes(text: str) -> list[int]:
    """Parse a comma-separated list of sizes; duplicates are dropped, order is ascending."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise ConfigurationError("--sizes needs at least one size, e.g. --sizes 4KiB,16MiB")
    return sorted({parse_size(p) for p in parts})


def format_size(n: int) -> str:
    """``4096 -> "4KiB"``, ``1536 -> "1.5KiB"``, ``100 -> "100B"``."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor:
            value = n / factor
            return f"{value:g}{unit}" if value == int(value) else f"{value:.3g}{unit}"
    return f"{n}B"
