"""Hierarchical Adasum: the mean over the ranks of each node, then the Adasum tree over the nodes.

What it computes, per layer: every node's mean of its ranks' vectors, then the tree of :mod:`adasum.rule.tree` over the
nodes in node order, each node standing for as many ranks as it has (so unequal nodes are weighted by their
size, and parallel inputs still give the mean over all ranks). Nodes are the groups of
``comm.Split_type(MPI.COMM_TYPE_SHARED)``; node order is the order of each node's lowest rank, and a node's
ranks need not be contiguous. One node gives the plain mean; one rank per node gives plain Adasum.
The serial definition is :func:`adasum.rule.reference.reference_hierarchical`.

How: with ``m`` the smallest number of ranks on any node, every fused buffer is cut into ``m`` slices.

1. Inside each node, a reduce-scatter (sum) leaves slice ``j`` of the node's sum on local rank ``j``
   (``j < m``; local ranks ``m`` and above contribute their data but hold no slice), scaled to the mean.
   16-bit floats are summed in float32, as MPI has no 16-bit sum, and rounded once to their dtype.
2. Across nodes, the ranks with local rank ``j`` (one per node, ordered by node) run the recursive-halving
   schedule of :mod:`adasum.schedules.halving` on slice ``j``. A layer may now be spread over the local ranks as well as
   over the nodes, so each layer's partial dot products are first summed over the node's ``m`` slice
   holders (gathered, then added in local-rank order, so all of them get bitwise the same sums) and then,
   by the schedule itself, over the nodes of the subtree.
3. Inside each node, one broadcast per slice holder (an allgather) hands every local rank the whole result.

Every element of the result is computed on exactly one rank per node, identically on every node, and only
copied after that, so all ranks end with bitwise identical results. Across nodes each slice holder sends
about ``(N-1)/N`` of its slice in each phase, so the bytes between nodes are those of a flat Adasum over
``N`` ranks, spread over ``m`` ranks per node.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from mpi4py import MPI

from .fusion import Group, Operand
from ..runtime.topology import NodeLayout, node_layout
from ..runtime.collectives import Collectives
from ..runtime.transport import transport_for
from .halving import adasum_reduce, partials_summed_over

__all__ = ["hierarchical_reduce"]

_SMALL_FLOATS = ("float16", "bfloat16")


def _slice_bounds(n: int, slices: int) -> list[int]:
    """Start offsets of ``slices`` near-equal slices of ``n`` elements, and ``n`` at the end."""
    return [j * n // slices for j in range(slices + 1)]


def _slice_group(g: Operand, lo: int, hi: int) -> Operand:
    """``g`` restricted to ``buffer[lo:hi]``: every layer kept, its bounds clipped to the slice (an empty
    layer where it lies outside), so layer ``i`` is the same tensor on every local rank."""
    key = ("slice", lo, hi)
    group = g.memo.get(key)
    if group is None:
        bounds = np.clip(g.bounds - lo, 0, hi - lo)
        group = g.memo[key] = Group(g.adapter, g.device, g.dtype, list(g.indices), list(g.shapes), bounds)
    return Operand(group, g.buffer[lo:hi])


class _NodeCollectives:
    """The reduce-scatter and the allgather inside a node for one group."""

    def __init__(self, call, layout: NodeLayout, g: Operand):
        self.comm = layout.node_comm
        self.local_size = self.comm.Get_size()
        self.g = g
        self.transport = Collectives(call, transport_for(call, self.comm, g.adapter, g.device, g.buffer))
        edges = _slice_bounds(g.size, layout.slices)
        self.counts = [edges[j + 1] - edges[j] if j < layout.slices else 0 for j in range(self.local_size)]
        self.displs = [edges[min(j, layout.slices)] for j in range(self.local_size)]

    def reduce_scatter_mean(self) -> None:
        """Leave this local rank's slice of the node's mean in ``g.buffer`` (nothing on non-holders)."""
        g, a, t = self.g, self.g.adapter, self.transport
        lo, n = self.displs[self.comm.Get_rank()], self.counts[self.comm.Get_rank()]
        if g.dtype in _SMALL_FLOATS:  # travels as 16 bits, summed in float32 (MPI has no 16-bit sum)
            bits = t.reduce_scatter_16bit(g.buffer, self.counts, g.dtype, self.local_size)
            if n:
                a.from_host(bits.view(np.uint8), g.buffer[lo:lo + n])
            return
        recv = t.kept(g.dtype, n, "node-recv")
        t.reduce_scatter_sum(g.buffer, recv, self.counts, g.dtype)
        if n:
            a.divide(recv, self.local_size)
            a.copy_(g.buffer[lo:lo + n], recv)

    def allgather(self) -> None:
        """Every local rank's ``g.buffer`` becomes the concatenation of the slice holders' slices."""
        bounds = [(d, d + n) for d, n in zip(self.displs, self.counts)]
        self.transport.broadcast_slices(self.g.buffer, bounds)


def hierarchical_reduce(call, groups: Sequence[Operand]) -> None:
    """Replace every group's buffer, in place and on every rank of the communicator of ``call``, by the
    hierarchical Adasum of all ranks' buffers: the mean inside each node, then the Adasum tree over the
    nodes, weighted by their numbers of ranks.

    Collective; every rank passes groups of the same sizes, dtypes and layer tables. With one node the
    result is the node's mean; with one rank per node it is the plain Adasum tree.
    """
    groups = [g for g in groups if g.size > 0]
    if call.ctx.size == 1 or not groups:
        return
    layout = node_layout(call)
    local = [_NodeCollectives(call, layout, g) for g in groups] if layout.node_comm.Get_size() > 1 else []
    for c in local:
        c.reduce_scatter_mean()

    if layout.cross_comm != MPI.COMM_NULL and len(layout.nodes) > 1:
        edges = [_slice_bounds(g.size, layout.slices) for g in groups]
        j = layout.local_rank
        slices = [_slice_group(g, e[j], e[j + 1]) for g, e in zip(groups, edges)]
        transports = [transport_for(call, layout.cross_comm, s.adapter, s.device, g.buffer)
                      for s, g in zip(slices, groups)]
        adasum_reduce(call, layout.cross_comm, slices, transports, counts=layout.counts,
                      local_sum=partials_summed_over(call, layout.slice_comm))

    for c in local:
        c.allgather()
