"""Adasum by recursive doubling of whole vectors: the schedule for small messages.

At level l (l = 1 … k) rank v swaps its whole current vector with v XOR 2^(l-1) and both combine the pair
locally, the lower subtree's vector on the left: the same pairs as recursive halving (:mod:`adasum.rule.tree`).
Each rank sends log2(P)·N bytes instead of about 2·N, but makes k message rounds instead of 2k plus the
per-level dot-product sums, which is what counts when N is small: there the cost of a call is its rounds.

Both partners compute the same coefficients from the same two vectors with the same kernel and operand
order, so they hold bitwise the same result after every level and every rank ends with the same bits.

:class:`SmallCall` runs the same schedule for one host float32/float64 group as one compiled call
(``_kernels.small_doubling``), which executes the program :meth:`SmallCall.program` derives from the same
tree geometry: the same messages and kernel calls, with no Python between them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from mpi4py import MPI

from ..rule import tree
from ..runtime import waiting
from ..adapters import nonempty
from ..rule.dtypes import itemsize
from ..call.fusion import Operand, layer_spans
from ..runtime.transport import TAG, Transport
from ..call.agreement import AGREE_BYTES, resume
from .halving import fold_out

from ..kernels.native import compiled as _kernels  # None without a C compiler: SmallCall is then never made
from ..kernels.native import handle

__all__ = ["SmallCall", "adasum_reduce_doubling"]


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


class SmallCall:
    """:func:`adasum_reduce_doubling` of one plan's single host group (float32/float64, compiled kernels)
    on one context's communicator, as one compiled call: everything that stays the same between calls (the
    program derived from the tree, the layers) is worked out once."""

    def __init__(self, call, group, layers: list[int], span_array, count: int):
        ctx = call.ctx
        self.ctx, self.group = ctx, group
        self.layers, self.span_array, self.count = layers, span_array, count
        self.role = tree.role(ctx.size, ctx.rank)
        self.n = group.size
        self.nbytes = self.n * itemsize(group.dtype)
        self.program = self._program(call.lcomm) if self.nbytes < 1 << 31 else None
        fold, levels = self.role.fold, self.role.levels
        self.messages = 1 if self.role.out_of is not None else len(levels) + (fold is not None)
        self._keys = [(slot, group.adapter.kind, "cpu", group.dtype) for slot in ("fused", "recv")]
        self._entries = [ctx.buffers.entry(key) for key in self._keys]

    def _buffers(self) -> tuple:
        """The context's fused and receive buffers as numpy arrays of the group's size: read from the kept
        entries (which follow the buffers, so this holds none of its own)."""
        n = self.n
        (_, buf), (_, scr) = self._entries
        if buf is None or scr is None or len(buf) < n or len(scr) < n:
            ctx, g = self.ctx, self.group
            buf, scr = (ctx.buffers.host(g.adapter.kind, g.dtype, n, key[0]) for key in self._keys)
            self._entries = [ctx.buffers.entry(key) for key in self._keys]
        return (buf if len(buf) == n else buf[:n]), (scr if len(scr) == n else scr[:n])

    def _program(self, lcomm) -> np.ndarray:
        """The schedule as ``_kernels.small_doubling`` takes it (int64 fields, then 4 per level)."""
        h = handle
        r = self.role
        out = -1 if r.out_of is None else r.out_of
        fold = r.fold or (-1, 0, 0)
        head = [h(lcomm), h(MPI.BYTE), h(MPI.INT64_T), h(MPI.MAX), TAG, self.nbytes, out, *fold, len(r.levels)]
        body = [x for level in r.levels for x in (level.partner, level.count_left, level.count_right, int(level.upper))]
        return np.array(head + body, dtype=np.int64)

    def __call__(self, call, live: list, dst, digest: int, descs, patience: float) -> int:
        """The whole call, agreement on ``digest`` included, in one ``_kernels.small_doubling``: 0, -1 if
        the ranks disagree (nothing was sent; every rank must then explain), or MPI's error code. An
        agreement still waiting after ``patience`` seconds (the stall inspector's) goes on in
        :func:`adasum.call.agreement.resume`, as the general path's does (``descs`` describe the call there), and
        the call then resumes where it stopped. Counted in ``compiled_calls`` however it ends."""
        ctx = self.ctx
        buf, scr = self._buffers()
        scratch = ctx.agree_scratch
        if ctx.counters:
            ctx.record("compiled_calls", 1)
            ctx.record("scalar_bytes", AGREE_BYTES)
        wait = waiting.policy(call.waiting)
        rc = _kernels.small_doubling(buf, scr, live, dst, self.span_array, self.program, digest, scratch, patience,
                                     *wait)
        if rc == -2:
            resume(call, "adasum", descs, patience)
            rc = _kernels.small_doubling(buf, scr, live, dst, self.span_array, self.program, digest, scratch, -1.0,
                                         *wait)
        if rc == 0 and ctx.counters:
            ctx.record("sent_bytes", self.messages * self.nbytes, self.messages)
        return rc

    def live(self, items: list) -> list:
        return items if len(self.layers) == self.count else [items[i] for i in self.layers]
