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

from ..call.agreement import agree_exchange
from ..call.allreduce import adasum_allreduce_inplace
from ..rule.combine import coefficients
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
            host.copy_(self._tree(host, sizes, label))
        if host is not flat:
            flat.copy_(host)

    def _tree(self, x: torch.Tensor, sizes: tuple[int, ...], label: str) -> torch.Tensor:
        size, me = self.replicate.Get_size(), self.replicate.Get_rank()
        r = role(size, me)
        lengths = torch.tensor(sizes, dtype=torch.int64)
        what = f"adasum_replicas ({label})"
        with exchange.call_on(self.replicate, what) as call:
            agree_exchange(call, what, None, extra=(("elements", x.numel()), ("dtype", zlib.crc32(str(x.dtype).encode())),
                                                    ("layers", len(sizes))))
            if r.out_of is not None:  # folded out: hand the vector over, receive the root's result
                _swap(call, x, None, r.out_of, what)
                out = torch.empty_like(x)
                _swap(call, None, out, r.out_of, what)
                return out
            cur = x
            if r.fold is not None:
                partner, mine, theirs = r.fold
                other = torch.empty_like(x)
                _swap(call, None, other, partner, what)
                cur = self._combine(cur, other, lengths, mine, theirs)
            for level in r.levels:
                other = torch.empty_like(x)
                _swap(call, cur, other, level.partner, what)
                left, right = (other, cur) if level.upper else (cur, other)
                cur = self._combine(left, right, lengths, level.count_left, level.count_right)
            if r.fold is not None:
                _swap(call, cur, None, r.fold[0], what)
            return cur

    def _combine(self, a: torch.Tensor, b: torch.Tensor, lengths: torch.Tensor, count_a: int,
                 count_b: int) -> torch.Tensor:
        """Adasum of the layers of ``a`` (the left side) and ``b``, with dot products over the whole layer
        (summed over the shard group), rounded to the input dtype."""
        a64, b64 = a.to(torch.float64), b.to(torch.float64)
        partial = torch.stack([_segment_sums(a64 * b64, lengths), _segment_sums(a64 * a64, lengths),
                               _segment_sums(b64 * b64, lengths)], dim=1).numpy()
        if self.shard.Get_size() > 1:
            adasum_allreduce_inplace(partial, op="sum", comm=self.shard)
        ca, cb = coefficients(partial[:, 0], partial[:, 1], partial[:, 2], count_a, count_b)
        ca_t = torch.from_numpy(np.asarray(ca, dtype=np.float64)).repeat_interleave(lengths)
        cb_t = torch.from_numpy(np.asarray(cb, dtype=np.float64)).repeat_interleave(lengths)
        return (ca_t * a64 + cb_t * b64).to(a.dtype)


def _segment_sums(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The sum of each consecutive piece of ``values`` (``lengths`` elements each; 0 for an empty piece)."""
    return torch.segment_reduce(values, "sum", lengths=lengths, unsafe=True, initial=0.0)


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
