"""The buffers a context keeps between calls (:class:`Buffers`)."""

from __future__ import annotations

import numpy as np

from ..adapters import Adapters
from ..adapters.base import host_numpy
from ..rule.dtypes import itemsize
from .hugepages import empty_on_huge_pages

__all__ = ["Buffers"]


class Buffers:
    """The buffers a context keeps between calls, one per (slot, array kind, device, dtype), each grown to
    the largest request and shared by all plans: the receive buffer of the schedules (half the largest fused
    buffer for halving at a power-of-two number of ranks; all of it for doubling, and on the rank that takes
    a folded-out partner's vector), the fused buffer of in-place calls that need one, the float32
    buffers of the hierarchical mode's 16-bit sums, and the page-locked host buffers of staged transfers."""

    def __init__(self, adapters: Adapters) -> None:
        self._adapters = adapters  # the context's: they make the buffers
        self._kept: dict[tuple, list] = {}
        self.generation = 0  # changes whenever a kept buffer is replaced or released

    def _entry(self, key: tuple) -> list:
        """The kept ``[buffer, numpy view of it or None]`` of ``key``, ``[None, None]`` until first used."""
        entry = self._kept.get(key)
        if entry is None:
            entry = self._kept[key] = [None, None]
        return entry

    def get(self, kind: str, device: str, dtype: str, n: int, slot: str):
        """``n`` elements of a kept flat buffer of ``kind`` (as the context's adapters make it), on ``device``."""
        entry = self._entry((slot, kind, device, dtype))
        if entry[0] is None or len(entry[0]) < n:
            self.generation += 1
            entry[1] = None
            entry[0] = None  # the old buffer goes before the new one is made
            adapter = self._adapters.of(kind)
            if device == "cpu":  # MPI moves large messages out of huge pages faster (adasum.runtime.hugepages)
                entry[0] = empty_on_huge_pages(lambda count: adapter.empty(count, dtype, device), max(n, 1),
                                               itemsize(dtype), host_numpy)
            else:
                entry[0] = adapter.empty(max(n, 1), dtype, device)
        buf = entry[0]
        return buf if len(buf) == n else buf[:n]

    def host(self, kind: str, dtype: str, n: int, slot: str) -> np.ndarray:
        """:meth:`get` of a host buffer, as a numpy array (the same memory, for torch CPU buffers)."""
        view = self.host_whole(kind, dtype, n, slot)
        return view if len(view) == n else view[:n]

    def host_whole(self, kind: str, dtype: str, n: int, slot: str) -> np.ndarray:
        """The whole kept host buffer of :meth:`host` (at least ``n`` elements), as a numpy array (a torch
        bfloat16 buffer as its uint16 bits): a holder
        keeps it only as long as :attr:`generation` stays the same (and only weakly, so as not to keep a
        released buffer alive)."""
        entry = self._entry((slot, kind, "cpu", dtype))
        view = entry[1]
        if view is None or len(view) < n:
            self.get(kind, "cpu", dtype, n, slot)
            view = entry[1] = host_numpy(entry[0])
        return view

    def staging(self, kind: str, device: str, which: int, nbytes: int) -> np.ndarray:
        """Host bytes for staged transfers of ``kind``/``device`` buffers (``which``: 0 send, 1 receive),
        page-locked where the device has such memory."""
        entry = self._entry(("staging", kind, device, which))
        if entry[0] is None or entry[0].nbytes < nbytes:
            self.generation += 1
            entry[0] = None
            adapter = self._adapters.of(kind)
            if device == "cpu":  # nothing to lock: on huge pages, as the other kept host buffers
                entry[0] = empty_on_huge_pages(lambda count: adapter.host_bytes_empty(count, device),
                                               max(nbytes, 1 << 16), 1, lambda x: x)
            else:
                entry[0] = adapter.host_bytes_empty(max(nbytes, 1 << 16), device)
        return entry[0][:nbytes]

    def clear(self) -> None:
        self.generation += 1
        for entry in self._kept.values():
            entry[0] = entry[1] = None
        self._kept.clear()
