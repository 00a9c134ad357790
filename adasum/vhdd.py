"""Adasum by recursive vector halving and distance doubling, on fused flat buffers.

Reduce-scatter: at level l (l = 1 … k) rank v pairs with v XOR 2^(l-1), keeps one half of its current
segment, sends the other half and receives the partner's copy of the half it keeps. The two halves it then
holds are pieces of the two vectors being combined at this node of the tree (SPEC §3): the left subtree's
(lower ranks) and the right subtree's. Every layer's coefficients need dot products over the whole layer,
which is spread over the 2^l ranks of the subtree, so the partial [left·right, ‖left‖², ‖right‖²] of every
layer is summed over exactly those ranks, in one small exchange per level for all layers together. Each
rank then combines its piece. Allgather by recursive doubling in reverse order gives every rank the result.

Each rank sends (P-1)/P·N bytes in each phase, the same as a bandwidth-optimal allreduce. P = 2^k + r
folds the first r adjacent pairs first (SPEC §3): the odd rank of a pair hands its whole vector to the even
one, which combines the two locally, and receives the result at the end.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from mpi4py import MPI

from .combine import coefficients
from .fusion import Group, pieces, pooled
from .transport import Transport, scalar_sendrecv

__all__ = ["adasum_reduce", "fold_out"]

def _own_parts(g: Group, lo: int, layers, spans) -> list:
    """This rank's values of ``g.buffer[lo + s : lo + e]`` for each span, read from the caller's tensors."""
    b = g.bounds
    return [g.parts[i][lo + s - b[i]:lo + e - b[i]] for i, (s, e) in zip(layers, spans)]


def _pack_range(g: Group, lo: int, hi: int) -> None:
    """Copy ``[lo, hi)`` of the caller's tensors into ``g.buffer`` (the half this rank sends first)."""
    layers, spans = pieces(g.bounds, lo, hi)
    for part, (s, e) in zip(_own_parts(g, lo, layers, spans), spans):
        g.buffer[lo + s:lo + e] = part


def _layer_partials(groups, scratches, los, his, swap: bool):
    """Per-layer [left·right, ‖left‖², ‖right‖²] over this rank's segments, for all groups, flattened."""
    out, spans_by_group = [], []
    for g, scr, lo, hi in zip(groups, scratches, los, his):
        full = np.zeros((len(g.bounds) - 1, 3))
        layers, spans = pieces(g.bounds, lo, hi)
        if spans:
            if g.parts is not None:
                part = g.adapter.partial_dots_parts(_own_parts(g, lo, layers, spans), scr, spans)
            else:
                part = g.adapter.partial_dots(g.buffer[lo:hi], scr, spans)
            if swap:  # this rank holds the right-hand vector in `buffer`
                part = part[:, [0, 2, 1]]
            full[layers] = part
        out.append(full)
        spans_by_group.append((layers, spans))
    return np.concatenate(out).ravel() if out else np.zeros(0), spans_by_group


def _combine(groups, scratches, los, his, spans_by_group, sums, count_left, count_right, upper: bool):
    """Apply the coefficients of the summed partials to this rank's piece of every layer."""
    sums = sums.reshape(-1, 3)
    c_left, c_right = coefficients(sums[:, 0], sums[:, 1], sums[:, 2], count_left, count_right)
    mine, theirs = (c_right, c_left) if upper else (c_left, c_right)
    offset = 0
    for g, scr, lo, hi, (layers, spans) in zip(groups, scratches, los, his, spans_by_group):
        if spans:
            idx = np.asarray(layers) + offset
            if g.parts is not None:
                g.adapter.scaled_add_parts(g.buffer[lo:hi], _own_parts(g, lo, layers, spans), scr, spans,
                                           mine[idx], theirs[idx])
            else:
                g.adapter.scaled_add(g.buffer[lo:hi], scr, spans, mine[idx], theirs[idx])
        g.parts = None  # from here on the buffer holds this rank's values
        offset += len(g.bounds) - 1


def fold_out(groups: Sequence[Group], transports: Sequence[Transport], rank: int, extra: int) -> bool:
    """The folded-out rank of a pair (SPEC §3): hands its vector to its even partner and receives the
    result. True if this rank is one (and has its result); False for every other rank."""
    if not (rank < 2 * extra and rank % 2 == 1):
        return False
    for g, t in zip(groups, transports):
        t.send(g.buffer, rank - 1)
    for g, t in zip(groups, transports):
        t.recv(g.buffer, rank - 1)
    return True


def adasum_reduce(comm: MPI.Intracomm, groups: Sequence[Group], transports: Sequence[Transport], *,
                  counts: Sequence[int] | None = None,
                  local_sum: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
    """Replace every group's buffer, in place and on every rank, by the Adasum of all ranks' buffers.

    ``counts[r]`` is how many ranks rank r's vector stands for (1 each for plain Adasum; ranks per node in
    the hierarchical mode). ``local_sum``, if given, sums a rank's partial dot products with those of the
    ranks outside ``comm`` that hold the other pieces of the same vectors (the hierarchical mode).

    A group whose ``parts`` are set has not been packed: its values are read from ``parts`` (flat views of
    the caller's tensors) at the first level, which packs only the half it sends and writes the combined
    half it keeps, so an out-of-place call copies its input once less. Only ranks that take part in the
    first level of halving (not folded, P > 1) may be given such groups.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or not groups:
        return
    counts = list(counts) if counts is not None else [1] * size
    sum_local = local_sum or (lambda v: v)
    k = size.bit_length() - 1
    extra = size - (1 << k)

    def real(u: int) -> int:
        return 2 * u if u < extra else u + extra

    # --- fold the first `extra` adjacent pairs -----------------------------------------------------------
    if fold_out(groups, transports, rank, extra):
        return
    if rank < 2 * extra:
        scratches = [pooled(g, g.size, "recv") for g in groups]
        for g, t, scr in zip(groups, transports, scratches):
            t.recv(scr, rank + 1)
        los, his = [0] * len(groups), [g.size for g in groups]
        partials, spans = _layer_partials(groups, scratches, los, his, swap=False)
        _combine(groups, scratches, los, his, spans, sum_local(partials), counts[rank], counts[rank + 1],
                 upper=False)
        v = rank // 2
    else:
        v = rank - extra
    vcounts = [counts[2 * u] + counts[2 * u + 1] if u < extra else counts[u + extra] for u in range(1 << k)]

    # --- reduce-scatter with the combine at every level ----------------------------------------------------
    los, his = [0] * len(groups), [g.size for g in groups]
    history = []
    for level in range(1, k + 1):
        d = 1 << (level - 1)
        upper = bool(v & d)
        partner = real(v ^ d)
        history.append((los, his))
        new_los, new_his, scratches = [], [], []
        for g, t, lo, hi in zip(groups, transports, los, his):
            mid = lo + (hi - lo) // 2
            (klo, khi), (slo, shi) = ((mid, hi), (lo, mid)) if upper else ((lo, mid), (mid, hi))
            if g.parts is not None:
                _pack_range(g, slo, shi)
            scr = pooled(g, khi - klo, "recv")
            t.sendrecv(g.buffer[slo:shi], partner, scr, partner)
            new_los.append(klo)
            new_his.append(khi)
            scratches.append(scr)
        los, his = new_los, new_his
        partials, spans = _layer_partials(groups, scratches, los, his, swap=upper)
        sums = sum_local(partials)
        # Sum over the 2^level ranks of this subtree by recursive doubling, always lower half + upper half,
        # so that every rank of the subtree gets bitwise the same sums, hence the same coefficients.
        for j in range(level):
            other = scalar_sendrecv(comm, sums, real(v ^ (1 << j)))
            sums = other + sums if v & (1 << j) else sums + other
        base = (v >> level) << level
        _combine(groups, scratches, los, his, spans, sums,
                 sum(vcounts[base:base + d]), sum(vcounts[base + d:base + 2 * d]), upper)

    # --- allgather by recursive doubling -------------------------------------------------------------------
    for level in range(k, 0, -1):
        d = 1 << (level - 1)
        partner = real(v ^ d)
        plos, phis = history[level - 1]
        for g, t, lo, hi, plo, phi in zip(groups, transports, los, his, plos, phis):
            olo, ohi = (plo, lo) if v & d else (hi, phi)
            t.sendrecv(g.buffer[lo:hi], partner, g.buffer[olo:ohi], partner)
        los, his = plos, phis

    if rank < 2 * extra:
        for g, t in zip(groups, transports):
            t.send(g.buffer, rank + 1)
