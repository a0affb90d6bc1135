"""Memory sizes: parse what users type (``20GB``, ``70GiB``) and print bytes back."""

from __future__ import annotations

import re

from autotune.errors import UsageError

# Decimal units are powers of 1000 and binary units powers of 1024, as the SI and
# IEC define them: 20GB and 20GiB differ by 7%, enough to matter for a budget.
_UNITS = {
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)\s*$")


def parse_memory(text: str) -> int:
    """Return the byte count of a memory size such as ``20GB`` or ``1.5GiB``.

    >>> parse_memory("20GB"), parse_memory("1GiB")
    (20000000000, 1073741824)

    A bare number, an unknown unit and a size of zero are refused: a budget must
    say which unit it means.
    """
    match = _PATTERN.match(text or "")
    allowed = ", ".join(_UNITS)
    if not match:
        raise UsageError(
            f"memory size {text!r} is not a number with a unit; write it like 20GB or 70GiB "
            f"(units: {allowed})"
        )
    number, unit = float(match.group(1)), match.group(2)
    canonical = {u.lower(): u for u in _UNITS}.get(unit.lower())
    # Case matters only between "b" and "B"; "gib" and "GIB" are unambiguous, but
    # "Gb" reads as gigabits, so it is refused rather than guessed.
    if canonical is None or (unit != canonical and unit[-1] == "b"):
        raise UsageError(f"memory size {text!r} has unknown unit {unit!r}; use one of {allowed}")
    size = int(number * _UNITS[canonical])
    if size <= 0:
        raise UsageError(f"memory size {text!r} must be greater than zero")
    return size


def format_bytes(size: float) -> str:
    """Print a byte count in binary units with three significant figures (``1.25 GiB``)."""
    value = float(size)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def rate_unit(unit: str = "tokens", short: bool = True) -> str:
    """How throughput in ``unit`` is written: ``tok/s`` (``tokens/s`` in full) for tokens, else ``images/s``."""
    if unit == "tokens":
        return "tok/s" if short else "tokens/s"
    return f"{unit}/s"
