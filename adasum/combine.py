"""The pairwise Adasum rule and its size-weighted form (docs/design.md), in plain numpy.

Everything here is float64 and free of MPI: the distributed schedule and the serial reference both get
their coefficients from :func:`coefficients`, so the two can only differ by where sums are split.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["coefficients", "combine"]


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
