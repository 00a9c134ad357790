"""Adasum by recursive doubling of whole vectors: the schedule for small messages.

At level l (l = 1 … k) rank v swaps its whole current vector with v XOR 2^(l-1) and both combine the pair
locally, the lower subtree's vector on the left (SPEC §3 pairs the same ranks as :mod:`adasum.vhdd`). Each
rank sends log2(P)·N bytes instead of about 2·N, but makes k message rounds instead of 2k plus the
per-level dot-product sums, which is what counts when N is small: there the cost of a call is its rounds.

Both partners compute the same coefficients from the same two vectors with the same kernel and operand
order, so they hold bitwise the same result after every level and every rank ends with the same bits.
P = 2^k + r folds the first r adjacent pairs exactly as :mod:`adasum.vhdd` does.
"""

from __future__ import annotations

from typing import Sequence

from mpi4py import MPI

from .combine import coefficients
from .fusion import Group, layer_spans, pooled
from .transport import Transport
from .vhdd import fold_out, home

__all__ = ["adasum_reduce_doubling"]


def _combine_pair(groups, spans, scratches, count_left: int, count_right: int, upper: bool, last: bool) -> None:
    """``Adasum(left, right)`` into the buffer (or, at the ``last`` level, where the result goes), where this
    rank's buffer holds the right vector if ``upper``."""
    for g, (layers, sp), scr in zip(groups, spans, scratches):
        if not sp:
            continue
        left, right = (scr, g.buffer) if upper else (g.buffer, scr)
        d = g.adapter.partial_dots(left, right, sp)
        c_left, c_right = coefficients(d[:, 0], d[:, 1], d[:, 2], count_left, count_right)
        # Both partners make the same kernel call (left first), so they hold the same bits.
        dst = home(g, 0, g.size, layers, sp) if last else g.buffer
        g.adapter.scaled_add(left, right, sp, c_left, c_right, dst=dst)


def adasum_reduce_doubling(comm: MPI.Intracomm, groups: Sequence[Group], transports: Sequence[Transport], *,
                           counts: Sequence[int] | None = None) -> None:
    """Replace every group's buffer, in place and on every rank, by the Adasum of all ranks' buffers.

    ``counts[r]``: how many ranks rank r's vector stands for (1 each for plain Adasum). The buffers must
    be packed; a group that ``writes_parts`` gets its result written into the caller's tensors.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or not groups:
        return
    counts = list(counts) if counts is not None else [1] * size
    k = size.bit_length() - 1
    extra = size - (1 << k)

    def real(u: int) -> int:
        return 2 * u if u < extra else u + extra

    spans = [layer_spans(g) for g in groups]
    scratches = [pooled(g, g.size, "recv") for g in groups]

    if fold_out(groups, transports, rank, extra):
        return
    if rank < 2 * extra:
        for g, t, scr in zip(groups, transports, scratches):
            t.recv(scr, rank + 1)
        _combine_pair(groups, spans, scratches, counts[rank], counts[rank + 1], upper=False, last=False)
        v = rank // 2
    else:
        v = rank - extra
    vcounts = [counts[2 * u] + counts[2 * u + 1] if u < extra else counts[u + extra] for u in range(1 << k)]

    for level in range(1, k + 1):
        d = 1 << (level - 1)
        partner = real(v ^ d)
        for g, t, scr in zip(groups, transports, scratches):
            t.sendrecv(g.buffer, partner, scr, partner)
        base = (v >> level) << level
        _combine_pair(groups, spans, scratches, sum(vcounts[base:base + d]), sum(vcounts[base + d:base + 2 * d]),
                      upper=bool(v & d), last=level == k)

    if rank < 2 * extra:
        for g, t in zip(groups, transports):
            t.send(home(g, 0, g.size), rank + 1)
