"""Array adapters: everything the algorithm needs from numpy arrays, torch tensors and cupy arrays.

The schedules never look at an array's kind. They ask an adapter for a flat fused buffer, for per-layer
partial dot products over a piece of it, for the in-place combine ``a ← ca·a + cb·b``, and for an object
MPI can read. Compute stays on the array's device; only the (layers × 3) float64 partial sums cross to the
host, where :mod:`adasum.rule.combine` turns them into coefficients.

:class:`NumpyAdapter` (:mod:`.host`) serves numpy arrays, :class:`CupyAdapter` (:mod:`.cupy_arrays`) cupy
arrays and :class:`TorchAdapter` (:mod:`.torch_tensors`) torch tensors on the CPU or a CUDA device. Each
communicator's context holds one :class:`Adapters`. The methods whose kernels a setting chooses take the
settings of the call (``s``) as an argument.
"""

from __future__ import annotations

import sys

import numpy as np

from .. import settings as _settings
from ..kernels.native import compiled as _c_kernels  # None where the install could not build them
from .base import Adapter, CopyStream, nonempty, use_c
from .cupy_arrays import CupyAdapter
from .host import NumpyAdapter
from .torch_tensors import TorchAdapter

__all__ = ["Adapter", "Adapters", "CopyStream", "CupyAdapter", "NumpyAdapter", "TorchAdapter", "array_kind",
           "kernels_backend", "nonempty", "set_kernels_backend"]


def kernels_backend() -> str:
    """``"c"`` when host float buffers go through the compiled kernels under the current
    settings, else ``"numpy"``.

    The environment variable ``ADASUM_KERNELS=numpy`` (or :func:`set_kernels_backend`) selects the numpy
    kernels.
    """
    return "c" if use_c(_settings.current()) else "numpy"


def set_kernels_backend(name: str) -> None:
    """Select ``"c"`` (the compiled kernels; ImportError if they were not built) or ``"numpy"``: the setting
    ``kernels`` of :func:`adasum.configure`."""
    if name == "c" and _c_kernels is None:
        raise ImportError("adasum.kernels._kernels was not built (no C compiler at install time?)")
    _settings.configure(kernels=name)


class Adapters:
    """One set of adapters (numpy, and torch and cupy once their arrays appear), with their scratch and kept
    views: each communicator's context has its own, so calls on different communicators share none."""

    def __init__(self) -> None:
        self.numpy = NumpyAdapter()
        self._made: dict[str, Adapter] = {"numpy": self.numpy}

    def of(self, kind: str) -> Adapter:
        adapter = self._made.get(kind)
        if adapter is None:
            if kind == "torch":
                adapter = TorchAdapter(self.numpy)
            elif kind == "cupy":
                cupy = sys.modules["cupy"]
                adapter = CupyAdapter(cupy)
            else:
                raise ValueError(f"no adapter for arrays of kind {kind!r}")
            self._made[kind] = adapter
        return adapter

    def for_array(self, t) -> Adapter | None:
        """The adapter for array ``t``, or None if ``t`` is of no supported kind."""
        kind = array_kind(t)
        return None if kind is None else self.of(kind)

    def clear(self) -> None:
        for adapter in self._made.values():
            adapter.clear()


def array_kind(t) -> str | None:
    """``"numpy"``, ``"torch"`` or ``"cupy"`` for an array of a supported kind, else None.

    torch and cupy are looked up only if the user's program has imported them: an object cannot be a
    torch tensor unless torch is loaded.
    """
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(t, cupy.ndarray):  # first: cupy's test stand-in is made of numpy
        return "cupy"
    if isinstance(t, np.ndarray):
        return "numpy"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        return "torch"
    return None

