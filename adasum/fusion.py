"""Tensors ⇄ fused flat buffers, one per (array kind, device, dtype), each with its table of layers."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .arrays import Adapter

__all__ = ["Group", "group_pieces", "layer_spans", "make_groups", "pieces", "pooled", "release_buffers"]


@dataclass
class Group:
    """The tensors of one call that share an adapter, a device and a dtype, fused into one flat buffer.

    Layer ``i`` of the group is the call's tensor ``indices[i]`` and occupies
    ``buffer[bounds[i]:bounds[i + 1]]``.
    """

    adapter: Adapter
    device: str
    dtype: str
    indices: list[int] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    bounds: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    buffer: Any = None
    # True when `buffer` is the caller's own memory (an in-place call on one contiguous tensor).
    aliased: bool = False
    # layer_spans(self), computed once per plan
    spans: Any = None
    # Flat views of the caller's tensors, one per layer, where the schedules may use them directly
    parts: Any = None
    # False while this rank's values are still only in `parts` (not yet packed into `buffer`)
    packed: bool = True
    # True when the result goes into `parts` (an in-place call on tensors that lie apart), not `buffer`
    writes_parts: bool = False
    # What the schedules derive from the layer table alone (layer pieces of a range, message cuts), kept
    # with the plan: the same ranges come back on every call
    memo: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.bounds[-1])



def make_groups(tensors: Sequence[Any], adapters: Sequence[Adapter], descs) -> list[Group]:
    """Group tensors by (adapter kind, device, dtype) in order of first appearance; no memory is touched."""
    groups: dict[tuple, Group] = {}
    for i, (t, adapter, desc) in enumerate(zip(tensors, adapters, descs)):
        key = (adapter.kind, desc.device, desc.dtype)
        g = groups.get(key)
        if g is None:
            g = groups[key] = Group(adapter, desc.device, desc.dtype)
        g.indices.append(i)
        g.shapes.append(desc.shape)
    for g in groups.values():
        g.bounds = np.fromiter(itertools.accumulate((math.prod(s) for s in g.shapes), initial=0),
                               dtype=np.int64, count=len(g.shapes) + 1)
    return list(groups.values())


def layer_spans(g: Group) -> tuple[list[int], list[tuple[int, int]], np.ndarray]:
    """The group's non-empty layers, their ``(start, end)`` in the fused buffer, and the same spans as
    an int64 (n, 2) array (what the compiled kernels take)."""
    if g.spans is None:
        b = g.bounds
        layers = np.flatnonzero(b[1:] > b[:-1]).tolist()
        spans = [(int(b[i]), int(b[i + 1])) for i in layers]
        g.spans = layers, spans, np.array(spans, dtype=np.int64).reshape(-1, 2)
    return g.spans


def group_pieces(g: Group, lo: int, hi: int) -> tuple[list[int], list[tuple[int, int]]]:
    """:func:`pieces` of ``g``'s layer table, kept in ``g.memo`` (the lists are shared: do not modify)."""
    key = ("pieces", lo, hi)
    out = g.memo.get(key)
    if out is None:
        out = g.memo[key] = pieces(g.bounds, lo, hi)
    return out


def pieces(bounds: np.ndarray, lo: int, hi: int) -> tuple[list[int], list[tuple[int, int]]]:
    """The layers that overlap ``[lo, hi)`` and their overlaps, as offsets relative to ``lo``.

    Layers may straddle ``lo`` or ``hi``; empty layers never appear.
    """
    layers, spans = [], []
    if hi <= lo:
        return layers, spans
    i = int(np.searchsorted(bounds, lo, side="right")) - 1
    last = len(bounds) - 1
    while i < last and bounds[i] < hi:
        s, e = max(int(bounds[i]), lo), min(int(bounds[i + 1]), hi)
        if e > s:
            layers.append(i)
            spans.append((s - lo, e - lo))
        i += 1
    return layers, spans


_pool: dict[tuple, Any] = {}
_pool_generation = 0  # changes whenever a kept buffer is replaced or released


def pooled(g: Group, n: int, slot: str):
    """A flat buffer of ``n`` elements of ``g``'s kind, device and dtype, kept for later calls.

    Slots: ``"fused"`` (the in-place call's fused buffer) and ``"recv"`` (the halves received at each
    level). Keeping them avoids allocating, and faulting in, fresh memory on every call.
    """
    key = (slot, g.adapter.kind, g.device, g.dtype)
    buf = _pool.get(key)
    if buf is not None and len(buf) == n:
        return buf
    if buf is None or len(buf) < n:
        global _pool_generation
        _pool_generation += 1
        _pool.pop(key, None)
        buf = _pool[key] = g.adapter.empty(max(n, 1), g.dtype, g.device)
    return buf[:n]


def pool_generation() -> int:
    """Changes whenever :func:`pooled` replaces a buffer or :func:`release_buffers` drops them all: views
    of pooled buffers kept across calls are stale once it has changed."""
    return _pool_generation


def release_buffers() -> None:
    """Free the buffers kept between calls: the fused buffer of in-place calls and the receive buffer
    (half the largest fused buffer, per dtype), and the host staging buffers of device transfers."""
    from .transport import Transport

    global _pool_generation
    _pool_generation += 1
    _pool.clear()
    Transport._host.clear()
