"""Tensors ⇄ fused flat buffers, one per (array kind, device, dtype), each with its table of layers, and
where one call's data of such a group is reduced."""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import numpy as np

from ..adapters import Adapter

__all__ = ["Group", "Operand", "Placement", "TensorLayout", "group_pieces", "layer_spans", "make_groups", "pieces"]


@dataclass
class Group:
    """The tensors of one call that share an adapter, a device and a dtype: the layer table of their fused
    flat buffer. Layer ``i`` of the group is the call's tensor ``indices[i]`` and occupies
    ``[bounds[i], bounds[i + 1])`` of the fused index space. Kept with a plan across calls; what one call
    holds (buffers, views of the caller's tensors) lives in an :class:`Operand`."""

    adapter: Adapter
    device: str
    dtype: str
    indices: list[int] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    bounds: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    # layer_spans(self), computed once per plan
    spans: Any = None
    # What the schedules derive from the layer table alone (layer pieces of a range, message cuts), kept
    # with the plan: the same ranges come back on every call
    memo: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.bounds[-1])


class TensorLayout(enum.IntEnum):
    """Where the tensors of an in-place call lie (the compiled kernels' ``layout`` answers with these)."""

    OVERLAPPING = 0  # some share memory: packed, and written back in order
    APART = 1        # contiguous, writable, each on its own
    ADJACENT = 2     # back to back, in order, in one block: one flat buffer without a copy


class Placement(enum.Enum):
    """Where one call's data of a group lies while it is reduced, and where the result goes: chosen once,
    before the agreement, by :func:`adasum.call.plan.place`.

    ============  ==========================================  =============================================
    placement     this rank's values are read from            the result is left in
    ============  ==========================================  =============================================
    PACKED        the fused ``buffer`` (packed first)         ``buffer`` (returned, or written back)
    ALIASED       ``buffer``: the caller's tensors, which     ``buffer``, the caller's tensors themselves
                  are one flat buffer already
    READS_PARTS   ``parts`` (halving: no packing) until the   ``buffer``
                  first combine, then ``buffer``
    IN_PARTS      ``parts`` (halving, in place)               ``parts``; no fused buffer at all
    WRITES_PARTS  ``buffer`` (packed first; doubling)         ``parts``, at the last level (in place)
    ============  ==========================================  =============================================
    """

    PACKED = "packed"
    ALIASED = "aliased"
    READS_PARTS = "reads parts"
    IN_PARTS = "in parts"
    WRITES_PARTS = "writes parts"

    @property
    def packs(self) -> bool:
        """Whether the caller's tensors are packed into a fused buffer before the schedule runs."""
        return self in (Placement.PACKED, Placement.WRITES_PARTS)

    @property
    def writes_parts(self) -> bool:
        """Whether the result goes into the caller's tensors through ``parts``."""
        return self in (Placement.IN_PARTS, Placement.WRITES_PARTS)


class Operand(NamedTuple):
    """One call's data of one :class:`Group`: its :class:`Placement` and the buffers it names.

    ``buffer``: the fused flat buffer (None for ``IN_PARTS``). ``parts``: flat views of the caller's
    tensors, one per layer, for the placements that read or write them. The layer table's fields
    (``adapter``, ``bounds``, ``size``, …) read through to the group. Immutable: a schedule that moves the
    values (halving from ``parts`` into ``buffer``) keeps that in its own state.
    """

    group: Group
    buffer: Any = None
    placement: Placement = Placement.PACKED
    parts: Any = None

    @property
    def writes_parts(self) -> bool:
        return self.placement.writes_parts

    adapter = property(lambda self: self.group.adapter)
    device = property(lambda self: self.group.device)
    dtype = property(lambda self: self.group.dtype)
    indices = property(lambda self: self.group.indices)
    shapes = property(lambda self: self.group.shapes)
    bounds = property(lambda self: self.group.bounds)
    memo = property(lambda self: self.group.memo)
    size = property(lambda self: self.group.size)

    @property
    def spans(self):
        return layer_spans(self.group)


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


def layer_spans(g) -> tuple[list[int], list[tuple[int, int]], np.ndarray]:
    """The group's non-empty layers, their ``(start, end)`` in the fused buffer, and the same spans as
    an int64 (n, 2) array (what the compiled kernels take)."""
    g = g.group if isinstance(g, Operand) else g
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
