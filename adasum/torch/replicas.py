"""Adasum across replica groups of a sharded model: the tree of docs/design.md over the replicas, where each
leaf of the tree is a whole *group* of ranks (a shard group) holding one shard of every layer.

Rank (replica g, shard i) pairs with rank (replica h, shard i) at each level of the tree over replicas: the two
swap their shards of every layer, each computes the partial dot products ``a·b``, ``a·a``, ``b·b`` of its
shard in float64, and the shard group sums them (one small allreduce of 3 numbers per layer). The
coefficients then come from the whole layer's sums, so the result does not depend on how the layer is cut
into shards, and the two partners apply them to the same two shards in the same order: their results are
bitwise equal. A level's result is stored in the input dtype, as the library's schedules store theirs.

Every exchange is a numbered call of the library on the replicate communicator (agreement first, waits through
the stall inspector), and every dot-product sum a ``sum`` call of :func:`adasum.adasum_allreduce` on the shard
communicator: a mismatch between ranks is an error on every rank and a rank that does not arrive is named.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch
from mpi4py import MPI

from ..runtime.agreement import agree_exchange
from ..call.allreduce import adasum_allreduce_inplace
from ..rule.combine import NO_SCALE, coefficients
from ..rule.tree import role
from ..runtime import exchange, stall
from ..runtime.transport import TAG

__all__ = ["ReplicaTree"]


class ReplicaTree:
    """Reduces a flat buffer of layers (a sharded model's gradient shards) across the replicas.

    ``replicate``: this rank and the ranks that hold the same shard in the other replicas, in replica order;
    ``shard``: the ranks of this rank's replica, in shard order. ``op``: ``"adasum"``, ``"sum"`` or
    ``"mean"``. Collective over the ranks of both communicators."""

    __slots__ = ("replicate", "shard", "op")

    def __init__(self, replicate: MPI.Intracomm, shard: MPI.Intracomm, op: str):
        self.replicate, self.shard, self.op = replicate, shard, op

    def reduce_(self, flat: torch.Tensor, sizes: tuple[int, ...], label: str) -> None:
        """Reduce ``flat`` (1-D, contiguous; its consecutive pieces of ``sizes`` elements are the layers) in
        place across the replicas. ``label`` names the buffer in errors."""
        if self.replicate.Get_size() == 1:
            return
        host = flat if flat.device.type == "cpu" else flat.detach().cpu()
        if self.op in ("sum", "mean"):
            adasum_allreduce_inplace(host, op=self.op, comm=self.replicate)
        else:
            self._tree(host, sizes, label)
        if host is not flat:
            flat.copy_(host)

    def _tree(self, x: torch.Tensor, sizes: tuple[int, ...], label: str) -> None:
        size, me = self.replicate.Get_size(), self.replicate.Get_rank()
        r = role(size, me)
        ends = np.cumsum(sizes, dtype=np.int64)
        pieces = np.stack([ends - np.asarray(sizes, dtype=np.int64), ends], axis=1)
        what = f"adasum_replicas ({label})"
        with exchange.call_on(self.replicate, what) as call:
            agree_exchange(call, what, None, extra=(("elements", x.numel()), ("layers", len(sizes)),
                                                    ("dtype", zlib.crc32(str(x.dtype).encode()))))
            if r.out_of is not None:  # folded out: hand the vector over, receive the root's result
                _swap(call, x, None, r.out_of, what)
                _swap(call, None, x, r.out_of, what)
                return
            combine = _Combine(call, self.shard, pieces)
            other = torch.empty_like(x)
            if r.fold is not None:
                partner, mine, theirs = r.fold
                _swap(call, None, other, partner, what)
                combine(x, other, mine, theirs)
            for level in r.levels:
                _swap(call, x, other, level.partner, what)
                left, right = (other, x) if level.upper else (x, other)
                combine(left, right, level.count_left, level.count_right, dst=x)
            if r.fold is not None:
                _swap(call, x, None, r.fold[0], what)


class _Combine:
    """Adasum of the layers of two buffers, their dot products over the whole layer (summed over the shard
    group), by the library's kernels (the array adapter's dot products and scaled add): float64 dot
    products and coefficients, the result rounded once to the input dtype."""

    __slots__ = ("call", "shard", "pieces", "adapter")

    def __init__(self, call, shard: MPI.Intracomm, pieces: np.ndarray):
        self.call, self.shard, self.pieces = call, shard, pieces
        self.adapter = call.ctx.adapters.of("torch")

    def __call__(self, a: torch.Tensor, b: torch.Tensor, count_a: int, count_b: int, dst=None) -> None:
        """``dst`` (default ``a``) ← Adasum(a, b), ``a`` the left side."""
        s = self.call.settings
        partial = self.adapter.partial_dots(a, b, self.pieces, s=s)
        if partial.shape[1] == 4:  # float64 data: rows at a scale 4**k of their own (adasum.rule.combine)
            k = np.where(partial[:, 3] == NO_SCALE, 0.0, partial[:, 3])[:, None]
            partial = np.ldexp(partial[:, :3], (2 * k).astype(np.int64))
        partial = np.ascontiguousarray(partial, dtype=np.float64)
        if self.shard.Get_size() > 1:
            adasum_allreduce_inplace(partial, op="sum", comm=self.shard)
        ca, cb = coefficients(partial[:, 0], partial[:, 1], partial[:, 2], count_a, count_b)
        self.adapter.scaled_add(a, b, self.pieces, np.asarray(ca, dtype=np.float64),
                                np.asarray(cb, dtype=np.float64), a if dst is None else dst, s=s)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


def _swap(call, send: torch.Tensor | None, recv: torch.Tensor | None, partner: int, what: str) -> None:
    """Send ``send`` to and/or receive ``recv`` from ``partner`` on the library's duplicate, watched by the
    stall inspector."""
    reqs = []
    if recv is not None:
        reqs.append(call.lcomm.Irecv([_bytes(recv), MPI.BYTE], partner, TAG))
    nbytes = 0
    if send is not None:
        data = _bytes(send.contiguous())
        nbytes = data.nbytes
        reqs.append(call.lcomm.Isend([data, MPI.BYTE], partner, TAG))
    call.record("sent_bytes", nbytes, len(reqs))
    stall.wait(call, reqs, "exchange", nbytes, label=what)
