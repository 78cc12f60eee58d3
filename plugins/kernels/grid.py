"""Host-side launch arithmetic in plain Python.

`triton.cdiv` / `triton.next_power_of_2` are Triton constexpr functions whose behaviour depends
on how triton was imported (compiled vs interpreter mode); launch code uses these instead.
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative a and positive b."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
