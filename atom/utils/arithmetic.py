"""Integer arithmetic that sizes things in whole units: blocks, tiles, groups."""

from __future__ import annotations

from typing import TypeVar

# An int or an integer tensor: `//` floors on both, so one expression serves both.
Integral = TypeVar("Integral")


def ceil_div(a: Integral, b: int) -> Integral:
    """ceil(a / b) for b > 0, exact on integers (no float rounding)."""
    return -(-a // b)
