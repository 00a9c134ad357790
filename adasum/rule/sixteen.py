"""float16 and bfloat16 on the host in plain numpy: widening to float64 and rounding float64 once to the
16-bit type, as the compiled kernels do (numpy has no bfloat16: its values travel as their uint16 bits).

Rounding is to nearest, ties to even, from the float64 value itself (never through a float32 rounding to
nearest first, which could round twice); a NaN stays a quiet NaN with its leading payload bits.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SIXTEEN", "narrow", "round_to", "widen"]

SIXTEEN = ("float16", "bfloat16")


def widen(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float16 values, or bfloat16 values given as uint16 bits, as float64 (exact); into ``out`` if given."""
    if x.dtype == np.uint16:
        x = (x.astype(np.uint32) << 16).view(np.float32)
    if out is None:
        return x.astype(np.float64)
    out[...] = x
    return out


def _odd_float32(values: np.ndarray) -> np.ndarray:
    """The uint32 bits of float64 ``values`` rounded to float32 to odd (truncated, the last bit set where
    anything was cut off): rounding that once more to a type of at most 22 bits of precision rounds the
    float64 value correctly."""
    with np.errstate(over="ignore", invalid="ignore"):
        f = values.astype(np.float32)
        back = f.astype(np.float64)
        cut = back != values
        cut &= ~np.isnan(values)
        away = np.abs(back) > np.abs(values)
    u = f.view(np.uint32)
    u -= away.view(np.uint8)
    u |= cut.view(np.uint8)
    return u


def narrow(values: np.ndarray, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """float64 ``values`` rounded once to ``dtype``: a float16 array, or for bfloat16 a uint16 array of its
    bits; into ``out`` (of that type) if given."""
    if dtype == "float16":
        if out is None:
            with np.errstate(over="ignore"):
                return values.astype(np.float16)
        with np.errstate(over="ignore"):
            out[...] = values
        return out
    u = _odd_float32(np.asarray(values, dtype=np.float64))
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = (u >> 16) & 1
    r += u
    r += 0x7FFF
    r >>= 16
    if nan.any():
        r[nan] = (u[nan] >> 16) | 0x40
    if out is None:
        return r.astype(np.uint16)
    out[...] = r
    return out


def round_to(values, dtype: str) -> np.ndarray:
    """float64 ``values`` rounded once to ``dtype`` (any float dtype), as float64."""
    values = np.asarray(values, dtype=np.float64)
    if dtype == "float64":
        return values
    if dtype == "float32":
        with np.errstate(over="ignore"):
            return values.astype(np.float32).astype(np.float64)
    return widen(narrow(values, dtype))
