"""Adasum by recursive doubling of whole vectors: the schedule for small messages.

At level l (l = 1 … k) rank v swaps its whole current vector with v XOR 2^(l-1) and both combine the pair
locally, the lower subtree's vector on the left: the same pairs as recursive halving (:mod:`adasum.rule.tree`).
Each rank sends log2(P)·N bytes instead of about 2·N, but makes k message rounds instead of 2k plus the
per-level dot-product sums, which is what counts when N is small: there the cost of a call is its rounds.

Both partners compute the same coefficients from the same two vectors with the same kernel and operand
order, so they hold bitwise the same result after every level and every rank ends with the same bits.

The compiled small call (:mod:`adasum.schedules.small_call`) runs the same schedule for one host float
group (float32, float64, float16, bfloat16) as one compiled call: the same messages and kernel calls, with no
Python between them.
"""

from __future__ import annotations

from typing import Sequence

from mpi4py import MPI

from ..rule import tree
from ..adapters import nonempty
from .fusion import Operand, layer_spans
from ..runtime.transport import Transport
from .halving import fold_out

__all__ = ["adasum_reduce_doubling"]


def _combine_pair(s, groups, spans, scratches, count_left: int, count_right: int, upper: bool, last: bool) -> None:
    """``Adasum(left, right)`` into the buffer (or, at the ``last`` level, where the result goes), where this
    rank's buffer holds the right vector if ``upper``."""
    for g, (layers, sp, sp_array), scr in zip(groups, spans, scratches):
        if not sp:
            continue
        left, right = (scr, g.buffer) if upper else (g.buffer, scr)
        # Both partners make the same call (left first), so they hold the same bits.
        dst = (g.buffer if not g.writes_parts else nonempty(g.parts, layers)) if last else g.buffer
        g.adapter.pair(left, right, dst, sp, sp_array, count_left, count_right, s=s)


def adasum_reduce_doubling(call, comm: MPI.Intracomm, groups: Sequence[Operand], transports: Sequence[Transport], *,
                           counts: Sequence[int] | None = None) -> None:
    """Replace every group's buffer, in place and on every rank, by the Adasum of all ranks' buffers.

    ``counts[r]``: how many ranks rank r's vector stands for (1 each for plain Adasum). The buffers must
    be packed; a group that ``writes_parts`` gets its result written into the caller's tensors.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or not groups:
        return
    r = tree.role(size, rank, None if counts is None else tuple(counts))
    if r.out_of is not None:
        fold_out(groups, transports, r.out_of)
        return
    spans = [layer_spans(g) for g in groups]
    scratches = [t.kept(g.dtype, g.size) for g, t in zip(groups, transports)]
    if r.fold is not None:
        for t, scr in zip(transports, scratches):
            t.recv(scr, r.fold[0])
        _combine_pair(call.settings, groups, spans, scratches, r.fold[1], r.fold[2], upper=False, last=False)
    for i, level in enumerate(r.levels):
        for g, t, scr in zip(groups, transports, scratches):
            t.sendrecv(g.buffer, level.partner, scr, level.partner)
        _combine_pair(call.settings, groups, spans, scratches, level.count_left, level.count_right, level.upper,
                      last=i == len(r.levels) - 1)
    if r.fold is not None:
        for g, t, (layers, _, _) in zip(groups, transports, spans):
            t.send(g.buffer if not g.writes_parts else nonempty(g.parts, layers), r.fold[0])
