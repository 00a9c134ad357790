"""The compiled kernels (``adasum/_kernels.c``: float32/float64 dot products and combine, copies between
tensors and buffers, and the compiled small call), where the install could build them.

``compiled`` is the extension module, or None on an install without a C compiler; the numpy kernels of
:mod:`adasum.arrays` then do the same work (``adasum.kernels_backend()`` says which is in use).
"""

from __future__ import annotations

try:
    from . import _kernels as compiled
except ImportError:  # pragma: no cover - a build without a C compiler
    compiled = None

__all__ = ["compiled"]
