"""The schedules' way into the buffers their context keeps between calls (:class:`Scratch`)."""

from __future__ import annotations

import numpy as np

__all__ = ["Scratch"]


class Scratch:
    """The kept buffers of one array kind and device in a context's :class:`~adasum.runtime.buffers.Buffers`:
    the schedules' receive buffers and the host bytes of staged transfers."""

    __slots__ = ("_buffers", "_kind", "_device")

    def __init__(self, buffers, kind: str, device: str):
        self._buffers, self._kind, self._device = buffers, kind, device

    def kept(self, dtype: str, n: int, slot: str = "recv"):
        """``n`` elements of a buffer of this kind and device, kept in the context between calls."""
        return self._buffers.get(self._kind, self._device, dtype, n, slot)

    def stage(self, which: int, nbytes: int) -> np.ndarray:
        """Host bytes kept for staged transfers (``which``: 0 for what is sent, 1 for what is received)."""
        return self._buffers.staging(self._kind, self._device, which, nbytes)
