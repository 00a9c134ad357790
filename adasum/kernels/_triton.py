"""The two Triton kernels of the segmented device path (:mod:`adasum.kernels.segmented`).

Both walk a tile table: int64 rows ``(start, end, piece)`` of at most one tile's elements each, never
crossing a layer piece's bounds. One program handles one tile, ``BLOCK`` elements at a time in ``STEPS``
steps (``STEPS · BLOCK`` is the tile size; the loop has a fixed trip count and skips the steps past the
tile's end, so that the same kernels also run under triton's interpreter). This module
imports triton, so :mod:`adasum.kernels.segmented` imports it only where it is used (with ``TRITON_INTERPRET=1``
triton runs the same kernels on CPU tensors).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_dots(a_ptr, b_ptr, tiles_ptr, out_ptr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """``out[t] = [a·b, a·a, b·b]`` over tile ``t``, each element widened to float64 as it is read and the
    sums kept in float64 (``BLOCK`` running sums per quantity, folded by ``tl.sum``)."""
    t = tl.program_id(0)
    start = tl.load(tiles_ptr + 3 * t)
    end = tl.load(tiles_ptr + 3 * t + 1)
    offs = tl.arange(0, BLOCK)
    ab = tl.zeros([BLOCK], dtype=tl.float64)
    aa = tl.zeros([BLOCK], dtype=tl.float64)
    bb = tl.zeros([BLOCK], dtype=tl.float64)
    for i in range(STEPS):
        s = start + i * BLOCK
        if s < end:
            idx = s + offs
            m = idx < end
            x = tl.load(a_ptr + idx, mask=m, other=0.0).to(tl.float64)
            y = tl.load(b_ptr + idx, mask=m, other=0.0).to(tl.float64)
            ab += x * y
            aa += x * x
            bb += y * y
    tl.store(out_ptr + 3 * t, tl.sum(ab, axis=0))
    tl.store(out_ptr + 3 * t + 1, tl.sum(aa, axis=0))
    tl.store(out_ptr + 3 * t + 2, tl.sum(bb, axis=0))


@triton.jit
def tile_combine(a_ptr, b_ptr, dst_ptr, tiles_ptr, coef_ptr, BLOCK: tl.constexpr, STEPS: tl.constexpr,
                 WIDE: tl.constexpr):
    """``dst = ca·a + cb·b`` over tile ``t`` with the coefficients ``coef[piece] = (ca, cb)`` of its piece;
    computed in float64 (``WIDE``: float32 and float64 data) or float32 (16-bit data, coefficients rounded
    to float32), rounded once to ``dst``'s dtype. ``dst`` may be ``a`` or ``b``."""
    t = tl.program_id(0)
    start = tl.load(tiles_ptr + 3 * t)
    end = tl.load(tiles_ptr + 3 * t + 1)
    piece = tl.load(tiles_ptr + 3 * t + 2)
    p = tl.load(coef_ptr + 2 * piece)
    q = tl.load(coef_ptr + 2 * piece + 1)
    if not WIDE:
        p = p.to(tl.float32)
        q = q.to(tl.float32)
    offs = tl.arange(0, BLOCK)
    for i in range(STEPS):
        s = start + i * BLOCK
        if s < end:
            idx = s + offs
            m = idx < end
            if WIDE:
                x = tl.load(a_ptr + idx, mask=m, other=0.0).to(tl.float64)
                y = tl.load(b_ptr + idx, mask=m, other=0.0).to(tl.float64)
            else:
                x = tl.load(a_ptr + idx, mask=m, other=0.0).to(tl.float32)
                y = tl.load(b_ptr + idx, mask=m, other=0.0).to(tl.float32)
            r = x * p + y * q
            tl.store(dst_ptr + idx, r.to(dst_ptr.dtype.element_ty), mask=m)
