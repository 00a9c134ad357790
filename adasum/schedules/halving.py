"""Adasum by recursive vector halving and distance doubling, on fused flat buffers.

Reduce-scatter: at level l (l = 1 … k) rank v pairs with v XOR 2^(l-1), keeps one half of its current
segment, sends the other half and receives the partner's copy of the half it keeps. The two halves it then
holds are pieces of the two vectors being combined at this node of the tree (:mod:`adasum.rule.tree`): the left subtree's
(lower ranks) and the right subtree's. Every layer's coefficients need dot products over the whole layer,
which is spread over the 2^l ranks of the subtree, so the partial [left·right, ‖left‖², ‖right‖²] of every
layer is summed over exactly those ranks, in one small exchange per level for all layers together. Each
rank then combines its piece. Allgather by recursive doubling in reverse order gives every rank the result.

Each rank sends (P-1)/P·N bytes in each phase, the same as a bandwidth-optimal allreduce. P = 2^k + r
folds the first r adjacent pairs first: the odd rank of a pair hands its whole vector to the even
one, which combines the two locally, and receives the result at the end.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from mpi4py import MPI

from ..rule import tree
from ..rule.combine import NO_SCALE, coefficients, merge_partials, partial_width
from ..rule.dtypes import itemsize
from .fusion import Operand, Placement, group_pieces
from ..runtime.collectives import Collectives
from ..runtime.transport import Transport

__all__ = ["adasum_reduce", "fold_out", "partials_summed_over"]


class _Cursor:
    """One operand during a run of this schedule, and where its values are now: in the caller's tensors
    (``parts``) for ``IN_PARTS``, and for ``READS_PARTS`` until its first combine; else in ``buffer``. The
    operand's fields that the schedule reads are copied once."""

    __slots__ = ("in_parts", "size", "dtype", "bounds", "memo", "adapter", "buffer", "parts", "writes_parts")

    def __init__(self, op: Operand):
        self.in_parts = op.placement in (Placement.READS_PARTS, Placement.IN_PARTS)
        self.size, self.dtype, self.bounds, self.memo, self.adapter = op.size, op.dtype, op.bounds, op.memo, op.adapter
        self.buffer, self.parts, self.writes_parts = op.buffer, op.parts, op.writes_parts


def _range(g: _Cursor, lo: int, hi: int, in_parts: bool, layers=None, spans=None):
    """``[lo, hi)`` of the fused index space: a slice of ``g.buffer`` or, ``in_parts``, flat views of the
    pieces of the caller's tensors (``g.parts``) that hold it (``layers``/``spans`` as :func:`pieces`
    gives them, if known)."""
    if not in_parts:
        return g.buffer if lo == 0 and hi == g.size else g.buffer[lo:hi]
    if layers is None:
        layers, spans = group_pieces(g, lo, hi)
    b = g.bounds
    return [g.parts[i].reshape(-1)[lo + s - b[i]:lo + e - b[i]] for i, (s, e) in zip(layers, spans)]


def own(g: _Cursor, lo: int, hi: int, layers=None, spans=None):
    """This rank's current values of ``[lo, hi)``: in ``g.buffer``, or in the caller's tensors (see
    :class:`_Cursor`)."""
    return _range(g, lo, hi, g.in_parts, layers, spans)


def home(g: _Cursor, lo: int, hi: int, layers=None, spans=None):
    """Where the combined values of ``[lo, hi)`` go: ``g.buffer``, or the caller's tensors themselves."""
    return _range(g, lo, hi, g.writes_parts, layers, spans)




def _cuts(g: Operand, lo: int, hi: int) -> list[int]:
    """Where layers start inside ``[lo, hi)``, relative to ``lo`` (without 0)."""
    return [s for s, _ in group_pieces(g, lo, hi)[1] if s > 0]


def _coalesce(g: Operand, cuts: list[int], n: int, chunk_bytes: int) -> list[int]:
    """Keeps the cuts around segments of at least ``chunk_bytes``; merges runs of shorter segments."""
    small = max(1, chunk_bytes // itemsize(g.dtype))
    out, start, run = [], 0, False
    for c in [*cuts, n]:
        if c - start >= small:
            if run:
                out.append(start)
            out.append(c)
            run = False
        else:
            run = True
            if c - (out[-1] if out else 0) >= small:
                out.append(c)
                run = False
        start = c
    if not out or out[-1] != n:
        out.append(n)
    return out


def chunks(g: Operand, lo: int, hi: int, split: int) -> list[tuple[int, int]]:
    """The messages that carry ``[lo, hi)`` one way: one, or with ``split`` (the chunk size in bytes, 0 for
    none) one per layer piece of at least ``split`` bytes and one per run of smaller pieces. A function of
    the layer table alone, so that sender and receiver cut alike."""
    if hi <= lo:
        return []
    if not split:
        return [(lo, hi)]
    ends = _coalesce(g, _cuts(g, lo, hi), hi - lo, split)
    return [(lo + a, lo + b) for a, b in zip([0, *ends[:-1]], ends)]


def exchange_chunks(g: Operand, slo: int, shi: int, rlo: int, rhi: int, split: int):
    """Messages for swapping ``[slo, shi)`` (sent) against ``[rlo, rhi)`` (received): each range cut by
    :func:`chunks`, on its own. The partner, swapping the same two ranges the other way round, cuts its
    sends as we cut our receives, so message i of one direction has the same length on both sides; the
    two directions may have different numbers of messages (:meth:`Transport.exchange` finishes the longer
    list one way)."""
    if not split:
        return chunks(g, slo, shi, False), chunks(g, rlo, rhi, False)
    key = ("exchange", slo, shi, rlo, rhi, split)
    out = g.memo.get(key)
    if out is None:
        out = g.memo[key] = (chunks(g, slo, shi, split), chunks(g, rlo, rhi, split))
    return out


def widths(groups) -> list[tuple[int, int]]:
    """(layers, columns) of every group's block of partials (see :func:`adasum.rule.combine.merge_partials`)."""
    return [(len(g.bounds) - 1, partial_width(g.dtype)) for g in groups]


def _layer_partials(s, groups, scratches, los, his, swap: bool):
    """Per-layer [left·right, ‖left‖², ‖right‖²] (and the scale, for float64) over this rank's segments, for
    all groups, flattened."""
    out, spans_by_group = [], []
    for g, scr, lo, hi in zip(groups, scratches, los, his):
        width = partial_width(g.dtype)
        full = np.zeros((len(g.bounds) - 1, width))
        if width == 4:
            full[:, 3] = NO_SCALE  # layers this rank holds nothing of
        layers, spans = group_pieces(g, lo, hi)
        if spans:
            part = g.adapter.partial_dots(own(g, lo, hi, layers, spans), scr, spans, s=s)
            if swap:  # this rank holds the right-hand vector
                part = part[:, [0, 2, 1, 3][:width]]
            full[layers] = part
        out.append(full)
        spans_by_group.append((layers, spans))
    return np.concatenate([o.ravel() for o in out]) if out else np.zeros(0), spans_by_group


def _combine(s, groups, scratches, los, his, spans_by_group, sums, count_left, count_right, upper: bool):
    """Apply the coefficients of the summed partials to this rank's piece of every layer."""
    rows = []
    at = 0
    for g in groups:
        n, width = len(g.bounds) - 1, partial_width(g.dtype)
        rows.append(sums[at:at + n * width].reshape(n, width)[:, :3])
        at += n * width
    sums = np.concatenate(rows) if rows else np.zeros((0, 3))
    c_left, c_right = coefficients(sums[:, 0], sums[:, 1], sums[:, 2], count_left, count_right)
    mine, theirs = (c_right, c_left) if upper else (c_left, c_right)
    offset = 0
    for g, scr, lo, hi, (layers, spans) in zip(groups, scratches, los, his, spans_by_group):
        if spans:
            idx = np.asarray(layers) + offset
            dst = home(g, lo, hi, layers, spans) if g.writes_parts or g.in_parts else None  # None: in place
            g.adapter.scaled_add(own(g, lo, hi, layers, spans), scr, spans, mine[idx], theirs[idx], dst=dst, s=s)
        g.in_parts = g.writes_parts  # from here on the values are where the result goes
        offset += len(g.bounds) - 1


def fold_out(groups: Sequence[Operand], transports: Sequence[Transport], partner: int, split: int = 0) -> None:
    """The folded-out rank of a pair: hands its vector to its even ``partner`` and receives the result."""
    _fold_out([_Cursor(g) for g in groups], transports, partner, split)


def _fold_out(groups: Sequence[_Cursor], transports: Sequence[Transport], partner: int, split: int) -> None:
    for g, t in zip(groups, transports):
        t.exchange([own(g, a, b) for a, b in chunks(g, 0, g.size, split)], partner, [], partner)
    for g, t in zip(groups, transports):
        t.exchange([], partner, [home(g, a, b) for a, b in chunks(g, 0, g.size, split)], partner)


def adasum_reduce(call, comm: MPI.Intracomm, groups: Sequence[Operand], transports: Sequence[Transport], *,
                  counts: Sequence[int] | None = None, split: int = 0,
                  local_sum: Callable[[np.ndarray, list], np.ndarray] | None = None) -> None:
    """Replace every group's buffer, in place and on every rank, by the Adasum of all ranks' buffers.

    ``counts[r]`` is how many ranks rank r's vector stands for (1 each for plain Adasum; ranks per node in
    the hierarchical mode). ``local_sum``, if given, sums a rank's partial dot products with those of the
    ranks outside ``comm`` that hold the other pieces of the same vectors (the hierarchical mode); it is
    given the partials and their :func:`widths`.

    An operand placed ``READS_PARTS`` is read from ``parts`` (flat views of the caller's tensors) until its
    first combine: halves are sent from there without packing them. One placed ``IN_PARTS`` (an in-place
    call on tensors that lie apart) is combined and gathered in the caller's tensors themselves, with no
    fused buffer at all; otherwise the result is left in ``buffer``. ``split`` (the same on every
    rank; bytes, 0 for none) cuts each exchange into the messages of :func:`chunks`; unpacked groups need it,
    since MPI sends fastest from contiguous memory.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or not groups:
        return
    r = tree.role(size, rank, None if counts is None else tuple(counts))
    groups = [_Cursor(g) for g in groups]
    layout = widths(groups)

    def sum_local(v: np.ndarray) -> np.ndarray:
        return v if local_sum is None else local_sum(v, layout)

    scalars = Collectives(call, transports[0])  # the per-level sums, on the first group's communicator
    s = call.settings

    # --- fold the first adjacent pairs ------------------------------------------------------------------
    if r.out_of is not None:
        _fold_out(groups, transports, r.out_of, split)
        return
    if r.fold is not None:
        partner, count_self, count_partner = r.fold
        scratches = [t.kept(g.dtype, g.size) for g, t in zip(groups, transports)]
        for g, t, scr in zip(groups, transports, scratches):
            t.exchange([], partner, [scr[a:b] for a, b in chunks(g, 0, g.size, split)], partner)
        los, his = [0] * len(groups), [g.size for g in groups]
        partials, spans = _layer_partials(s, groups, scratches, los, his, swap=False)
        _combine(s, groups, scratches, los, his, spans, sum_local(partials), count_self, count_partner, upper=False)

    # --- reduce-scatter with the combine at every level ----------------------------------------------------
    ranges = [tree.kept_ranges(g.size, r) for g in groups]
    for i, level in enumerate(r.levels):
        _reduce_level(s, scalars, groups, transports, ranges, i, level, r.virtual, split, sum_local, layout)

    # --- allgather by recursive doubling -------------------------------------------------------------------
    _allgather(groups, transports, ranges, r.levels, split)

    if r.fold is not None:
        for g, t in zip(groups, transports):
            t.exchange([own(g, a, b) for a, b in chunks(g, 0, g.size, split)], r.fold[0], [], r.fold[0])


def _reduce_level(s, scalars: Collectives, groups, transports, ranges, i: int, level, virtual: int, split: int,
                  sum_local, layout) -> None:
    """Level ``i`` of :func:`adasum_reduce`'s reduce-scatter: swap the halves with the level's partner,
    sum the partial dot products over the level's subtree, combine this rank's kept half."""
    los, his = [rg[i + 1][0] for rg in ranges], [rg[i + 1][1] for rg in ranges]
    scratches = []
    for g, t, rg in zip(groups, transports, ranges):
        (lo, hi), (klo, khi) = rg[i], rg[i + 1]
        slo, shi = (lo, klo) if level.upper else (khi, hi)  # the half the partner keeps
        scr = t.kept(g.dtype, khi - klo)
        sc, rc = exchange_chunks(g, slo, shi, klo, khi, split)
        t.exchange([own(g, a, b) for a, b in sc], level.partner, [scr[a - klo:b - klo] for a, b in rc], level.partner)
        scratches.append(scr)
    partials, spans = _layer_partials(s, groups, scratches, los, his, swap=level.upper)
    sums = sum_local(partials)
    # Sum over the ranks of this level's subtree by recursive doubling, always lower half + upper half,
    # so that every rank of the subtree gets bitwise the same sums, hence the same coefficients.
    for j, other_rank in enumerate(level.sum_partners):
        other = scalars.swap_scalars(sums, other_rank)
        sums = merge_partials(other, sums, layout) if virtual & (1 << j) else merge_partials(sums, other, layout)
    _combine(s, groups, scratches, los, his, spans, sums, level.count_left, level.count_right, level.upper)


def _allgather(groups, transports, ranges, levels, split: int) -> None:
    """:func:`adasum_reduce`'s allgather by recursive doubling, the levels in reverse."""
    for i in range(len(levels) - 1, -1, -1):
        level = levels[i]
        for g, t, rg in zip(groups, transports, ranges):
            (plo, phi), (lo, hi) = rg[i], rg[i + 1]
            olo, ohi = (plo, lo) if level.upper else (hi, phi)
            sc, rc = exchange_chunks(g, lo, hi, olo, ohi, split)
            t.exchange([own(g, a, b) for a, b in sc], level.partner, [own(g, a, b) for a, b in rc], level.partner)


def partials_summed_over(call, comm: MPI.Intracomm) -> Callable[[np.ndarray, list], np.ndarray] | None:
    """The ``local_sum`` of :func:`adasum_reduce` over ``comm``: a partial-dot-product vector summed over the
    ranks of ``comm`` that hold the other pieces of the same layers (a node's slice holders in the
    hierarchical mode, a shard group for the replicas of a sharded model), bitwise alike on each of them;
    None where ``comm`` has one rank."""
    if comm.Get_size() == 1:
        return None
    t = Collectives(call, Transport(call, comm, call.ctx.adapters.numpy, "cpu", staged=False))

    def local_sum(vec: np.ndarray, widths) -> np.ndarray:
        rows = t.allgather_scalars(vec)
        # Added in the order of comm's ranks, the same order on every holder.
        total = rows[0].copy()
        for row in rows[1:]:
            total = merge_partials(total, row, widths)
        return total

    return local_sum
