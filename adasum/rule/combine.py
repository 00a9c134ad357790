"""The pairwise Adasum rule and its size-weighted form (docs/design.md), in plain numpy.

Everything here is float64 and free of MPI: the distributed schedule and the serial reference both get
their coefficients from :func:`coefficients`, so the two can only differ by where sums are split.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["NO_SCALE", "TINY", "coefficients", "combine", "extend_range", "merge_partials", "partial_width"]


def coefficients(dot, norm_a, norm_b, count_a=1, count_b=1):
    """Coefficients ``(ca, cb)`` with ``Adasum(a, b) = ca·a + cb·b``.

    ``dot = a·b``, ``norm_a = ‖a‖²`` and ``norm_b = ‖b‖²`` may be scalars or arrays (one entry per layer).
    ``count_a`` and ``count_b`` are the numbers of ranks that ``a`` and ``b`` stand for; the rule weights
    each side's projection by its share ``count / (count_a + count_b)``, which is ½ for equal subtrees.
    A side whose squared norm is zero gets coefficient exactly 1, so ``Adasum(0, b) = b``.
    """
    total = float(count_a + count_b)
    w_a, w_b = count_a / total, count_b / total
    if isinstance(dot, np.ndarray) and dot.ndim == 1 and dot.size <= _FEW:
        # Few layers: Python floats (IEEE double, the same roundings as numpy's) cost less than ufuncs.
        ca, cb = [], []
        for d, na, nb in zip(dot.tolist(), np.asarray(norm_a).tolist(), np.asarray(norm_b).tolist()):
            ca.append(1.0 - w_a * _ratio(d, na))
            cb.append(1.0 - w_b * _ratio(d, nb))
        return np.array(ca), np.array(cb)
    dot = np.asarray(dot, dtype=np.float64)
    norm_a = np.asarray(norm_a, dtype=np.float64)
    norm_b = np.asarray(norm_b, dtype=np.float64)
    # dot / norm where the norm is non-zero, 0 where it is zero (so that the coefficient is exactly 1)
    with np.errstate(invalid="ignore", over="ignore"):  # inf/inf and overflow: NaN/Inf, on purpose
        q_a = np.divide(dot, norm_a, out=np.zeros(norm_a.shape), where=norm_a != 0.0)
        q_b = np.divide(dot, norm_b, out=np.zeros(norm_b.shape), where=norm_b != 0.0)
        ca, cb = 1.0 - w_a * q_a, 1.0 - w_b * q_b
    # A zero side contributes nothing, but a NaN/Inf on the other side must still poison the result:
    # 1·0 + nan·b is nan, so the non-finite input stays visible.
    return ca, cb


_FEW = 32


def _ratio(d: float, n: float) -> float:
    """``d / n`` rounded as numpy rounds it (inf/inf gives NaN, overflow inf); 0 where ``n`` is zero."""
    return d / n if n != 0.0 else 0.0


def combine(a, b, count_a=1, count_b=1):
    """``Adasum(a, b)`` of two arrays of one layer, computed and returned in float64."""
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"combine needs vectors of one size, got {a.size} and {b.size} elements")
    # The dot products of a and b scaled by a power of two that bounds them (exact): the coefficients are
    # ratios of them, which then neither overflow nor underflow for any finite float64 input.
    m = max(float(np.abs(a).max()), float(np.abs(b).max())) if a.size else 0.0
    # (As an exponent: 2**-e of a subnormal m is itself beyond the float64 range.)
    e = math.frexp(m)[1] if 0.0 < m < math.inf else 0
    x, y = np.ldexp(a, -e), np.ldexp(b, -e)
    ca, cb = coefficients(np.dot(x, y), np.dot(x, x), np.dot(y, y), count_a, count_b)
    return float(ca) * a + float(cb) * b


# Below this a squared norm may have lost bits to underflow (its elements' squares are subnormal), or be zero
# only because they all underflowed: such partials are computed again on the data scaled by a power of two.
TINY = 2.0 ** -900
# The exponent of partials that are all zero: they take no part in choosing a common scale.
NO_SCALE = -(2.0 ** 30)


def partial_width(dtype: str) -> int:
    """Columns of a group's partials: 4 for float64 (:func:`extend_range`), else 3."""
    return 4 if dtype == "float64" else 3


def dtype_of(x):
    return x[0].dtype if type(x) is list else x.dtype


def extend_range(part: np.ndarray, a, b, pieces) -> np.ndarray:
    """Float64 partials ``part`` (n, 3) as (n, 4) rows ``[a·b, a·a, b·b, k]`` meaning ``4**k`` times the
    first three, as BLAS's ``nrm2`` scales: a row that overflowed (Inf/NaN from finite data) or whose squared
    norms are below :data:`TINY` is computed again on its piece scaled by ``2**-k``, where ``2**k`` bounds
    its largest magnitude; the scaling is exact, and the Adasum coefficients only use ratios of partials of
    one scale. Other rows keep k = 0 (bitwise what they were), all-zero rows ``NO_SCALE``. ``a``, ``b``: flat
    buffers the pieces index (numpy, cupy or torch), or lists of one buffer per piece."""
    out = np.empty((len(part), 4))
    out[:, :3] = part
    out[:, 3] = 0.0
    with np.errstate(invalid="ignore"):
        redo = ~np.isfinite(part).all(axis=1) | (part[:, 1] < TINY) | (part[:, 2] < TINY)
    for i in np.flatnonzero(redo).tolist():
        s, e = pieces[i]
        x = a[i] if type(a) is list else a[s:e]
        y = b[i] if type(b) is list else b[s:e]
        m = max(float(abs(x).max()), float(abs(y).max())) if e > s else 0.0
        if m == 0.0:
            out[i] = (0.0, 0.0, 0.0, NO_SCALE)
        elif math.isfinite(m):  # NaN or Inf in the data: the partials stay non-finite, on purpose
            k = math.frexp(m)[1]
            xs, ys = _scale_down(x, k), _scale_down(y, k)
            out[i] = (float((xs * ys).sum()), float((xs * xs).sum()), float((ys * ys).sum()), k)
    return out


def _scale_down(x, k: int):
    """``x · 2**-k``, exact where the result is normal. Subnormal data has ``2**-k`` beyond the float64
    range: it is then scaled up in two steps (as the compiled kernel does)."""
    if k >= -1020:
        return x * math.ldexp(1.0, -k)
    half = -k // 2
    return x * math.ldexp(1.0, half) * math.ldexp(1.0, -k - half)


def _shift(k: np.ndarray, top: np.ndarray) -> np.ndarray:
    """Powers of two that bring partials of scale ``4**k`` to scale ``4**top`` (``top >= k``)."""
    return np.maximum(2 * (k - top), -4000).astype(np.int64)[:, None]


def merge_partials(first: np.ndarray, second: np.ndarray, widths) -> np.ndarray:
    """``first + second`` for flattened partials of several groups (``widths``: (rows, 3 or 4) per group):
    3-wide rows add; 4-wide rows (:func:`extend_range`) are brought to their larger scale first. The same
    operations in the same order whatever the data, so every rank adding the same two gets the same bits."""
    out = first + second
    at = 0
    for rows, width in widths:
        if width == 4 and rows:
            f = first[at:at + 4 * rows].reshape(rows, 4)
            g = second[at:at + 4 * rows].reshape(rows, 4)
            if (f[:, 3] != g[:, 3]).any():
                k = np.maximum(f[:, 3], g[:, 3])
                both = np.ldexp(f[:, :3], _shift(f[:, 3], k)) + np.ldexp(g[:, :3], _shift(g[:, 3], k))
                o = out[at:at + 4 * rows].reshape(rows, 4)
                o[:, :3] = both
                o[:, 3] = k
            else:
                out[at + 3:at + 4 * rows:4] = f[:, 3]
        at += width * rows
    return out


