"""Adasum across replica groups of a sharded model: the library's Adasum schedule over the replicas,
where each leaf of the tree is a whole *group* of ranks (a shard group) holding one shard of every layer.

Rank (replica g, shard i) reduces its shards over its replicate group (the ranks holding shard i in the
other replicas) with the library's own call (:func:`adasum.call.allreduce.allreduce_sharded_inplace`: the
recursive-halving schedule of docs/design.md), whose per-layer partial dot products ``a·b``, ``a·a``,
``b·b`` the shard group sums at every level (one small exchange of 3 numbers per layer, the hook the
hierarchical mode uses for a node's slices). The coefficients then come from the whole layer's sums, so
the result does not depend on how the layer is cut into shards, and every rank of a shard group takes the
same coefficients: their results are bitwise those of one tree over whole layers, in the input dtype.

The call is a numbered call of the library on the replicate communicator (agreement first, waits through
the stall inspector): a mismatch between ranks is an error on every rank and a rank that does not arrive
is named.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from ...call.allreduce import adasum_allreduce_inplace, allreduce_sharded_inplace
from ..window.compress import Wire

__all__ = ["ReplicaTree"]


class ReplicaTree:
    """Reduces a flat buffer of layers (a sharded model's gradient shards) across the replicas.

    ``replicate``: this rank and the ranks that hold the same shard in the other replicas, in replica order;
    ``shard``: the ranks of this rank's replica, in shard order. ``op``: ``"adasum"``, ``"sum"`` or
    ``"mean"``. ``wire``: how the shards travel (``compression``: their own dtype, or 16-bit floats, as
    :class:`~adasum.torch.DistributedOptimizer`'s). Collective over the ranks of both communicators."""

    __slots__ = ("replicate", "shard", "op", "wire")

    def __init__(self, replicate: MPI.Intracomm, shard: MPI.Intracomm, op: str, wire: Wire | None = None):
        self.replicate, self.shard, self.op = replicate, shard, op
        self.wire = wire or Wire(None)

    def reduce_(self, flat: torch.Tensor, sizes: tuple[int, ...]) -> None:
        """Reduce ``flat`` (1-D, contiguous; its consecutive pieces of ``sizes`` elements are the layers' shards)
        in place across the replicas."""
        if self.replicate.Get_size() == 1:
            return
        host = flat if flat.device.type == "cpu" else flat.detach().cpu()
        if self.wire.dtype is not None:  # each layer's shard cast to the wire's dtype (and scaled) and back
            if self.op in ("sum", "mean"):
                self.wire.sum_(list(host.split(sizes)), self.replicate, self.op == "mean")
            else:
                self.wire.adasum_(list(host.split(sizes)), self.replicate, shard=self.shard)
        elif self.op in ("sum", "mean"):
            adasum_allreduce_inplace(host, op=self.op, comm=self.replicate)
        else:
            allreduce_sharded_inplace(list(host.split(sizes)), self.replicate, self.shard)
        if host is not flat:
            flat.copy_(host)
