"""The arithmetic of 16-bit float sums: MPI has no float16 or bfloat16 sum, so the library's 16-bit sums
(``op="sum"``/``"mean"``, and the node means of the hierarchical mode) move the 16-bit bits and add them
here, in float32, in rank order, rounded once: the same bits on every rank."""

from __future__ import annotations

import numpy as np

__all__ = ["narrow_16bit", "sum_rows_16bit", "widen_16bit"]


def widen_16bit(bits: np.ndarray, dtype: str) -> np.ndarray:
    """float16 or bfloat16 values, given as their uint16 bits, as a new float32 array (exact)."""
    if dtype == "float16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def narrow_16bit(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``values`` rounded to the nearest float16 or bfloat16 (ties to even; NaN stays NaN), as
    uint16 bits: the rounding of torch's and numpy's casts."""
    if dtype == "float16":
        return values.astype(np.float16).view(np.uint16)
    u = values.view(np.uint32)
    r = u >> 16  # in place from here: half the time of the same arithmetic on temporaries
    r &= 1
    r += u
    r += 0x7FFF
    r >>= 16
    bits = r.astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        bits[nan] = 0x7FC0
    return bits




def sum_rows_16bit(rows: np.ndarray, dtype: str, divisor: int = 1) -> np.ndarray:
    """The sum of the rows of ``rows`` (one per rank, in rank order, each the uint16 bits of ``dtype``
    values), added in float32 in row order, divided by ``divisor``, rounded once to ``dtype``'s bits."""
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN carry on, as in a float sum
        acc = widen_16bit(rows[0], dtype)
        for j in range(1, len(rows)):
            acc += widen_16bit(rows[j], dtype)
        if divisor != 1:
            acc /= np.float32(divisor)
        return narrow_16bit(acc, dtype)
