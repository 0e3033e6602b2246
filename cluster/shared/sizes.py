"""Block counts and byte units, written once."""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (``b > 0``): e.g. the blocks that hold ``a`` tokens."""
    return -(-a // b)
