"""The compiled small call: a whole Adasum call by recursive doubling of one host float group (float32,
float64, float16, bfloat16 as its uint16 bits), as one call into the compiled kernels (``_kernels.small_doubling``), agreement included.

This module decides where it may run and runs it. A plan may hold one (:func:`small_call_for`, when the plan
is made: the doubling schedule, one group in the call's order, a float dtype on the host); a call takes
it (:func:`run_small`) under settings that allow it (:func:`allowed`) when its tensors are contiguous and
do not overlap. It executes the program :meth:`SmallCall._program` derives from :mod:`adasum.rule.tree`: the
same collective, messages and kernel calls as the general doubling schedule
(:mod:`adasum.schedules.doubling`), so ranks may take either, and it waits by the one waiting rule
(:mod:`adasum.runtime.waiting`, the compiled ``wait_rule``).
"""

from __future__ import annotations

import weakref

import numpy as np
from mpi4py import MPI

from ..runtime.faults import mpi_error
from ..rule import tree
from ..runtime import waiting
from ..rule.dtypes import itemsize
from .fusion import TensorLayout, layer_spans
from ..adapters.base import host_numpy
from ..runtime.transport import TAG
from ..runtime.agreement import AGREE_BYTES, explain, resume, with_companion
from ..kernels.native import compiled as _kernels  # None without a C compiler: SmallCall is then never made
from ..kernels.native import handle, mpi_bound

__all__ = ["SmallCall", "allowed", "run_small", "small_call_for"]

# The dtypes the compiled small call takes (bfloat16: torch's CPU tensors, as their uint16 bits).
_DTYPES = ("float32", "float64", "float16", "bfloat16")


def small_call_for(call, schedule_is_doubling: bool, one_group: bool, groups: list, count: int) -> "SmallCall | None":
    """The compiled small call of a plan of ``count`` tensors in ``groups`` (``one_group``: one group
    holding every tensor in order), or None where the plan's calls cannot take it."""
    active = [g for g in groups if g.size > 0]
    if not (schedule_is_doubling and one_group and _kernels is not None and len(active) == 1):
        return None
    g = active[0]
    if g.dtype not in _DTYPES or (g.adapter.kind, g.device) not in (("numpy", "cpu"),
                                                                                    ("torch", "cpu")):
        return None
    spans = layer_spans(g)
    small = SmallCall(call, g, spans[0], spans[2], count)
    return small if small.program is not None else None


def allowed(s) -> bool:
    """Whether calls under the settings ``s`` may take the compiled small call: the compiled kernels, bound
    to the MPI library, and no staging."""
    return s.gpu_transport != "staged" and _kernels is not None and s.kernels == "c" and s.native_mpi \
        and mpi_bound()


def run_small(call, plan, items: list, inplace: bool, extras: dict):
    """The call ``call`` of ``items`` (the plan ``plan``'s tensors, which holds a :class:`SmallCall`) as
    one compiled call; None where its tensors cannot take it (not contiguous, or overlapping in place): the
    general path then runs (or reports) it. ``extras``: :func:`adasum.call.plan.agreed_extras`."""
    small = plan.small
    live = small.live(items)
    g = small.group
    if g.adapter.kind == "torch":
        host = g.adapter.addresses(live)
        if host is None:
            return None
    else:
        host = live
        try:
            where = _kernels.layout(host, inplace)  # contiguous (and writable, in place), or it raises
        except (BufferError, ValueError):
            return None
        if where == TensorLayout.OVERLAPPING:
            return None  # the general path writes each result back in turn
    digest, extra, companion = plan.signature, extras["adasum"], call.companion
    if companion is not None:  # a caller's agreement rides along (adasum.runtime.agreement.Companion)
        if companion.error is not None:
            return None  # the general path fails the call on every rank
        digest, _, extra = with_companion(call, digest, None, extra)
    out = None if inplace else g.adapter.empty(g.size, g.dtype, g.device)
    dst = host if inplace else host_numpy(out)
    rc = small(call, host, dst, digest, plan.descs, extras["patience"])
    if rc == -4:
        return None  # in place on overlapping torch tensors (found in the compiled call, before any message)
    if rc == -1:
        raise explain(call, "adasum", plan.descs, None, extra)
    if rc:
        raise mpi_error(rc, call.what)
    if inplace:
        if host is not live:
            g.adapter.wrote_parts(items)
        return items
    return g.adapter.views(out, g.bounds, g.shapes)


class SmallCall:
    """:func:`~adasum.schedules.doubling.adasum_reduce_doubling` of one plan's single host float group
    (compiled kernels) on one context's communicator, as one compiled call: everything that stays the same between calls (the
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
        self._kept: tuple = (-1, None, None)  # (generation, weak references to the buffers) of the last call

    def _buffers(self) -> tuple:
        """The context's fused and receive buffers as numpy arrays of the group's size. Held weakly between
        calls, and only while the context's buffers stay the same (:attr:`Buffers.generation`), so that
        this keeps no buffer alive."""
        buffers, n, kept = self.ctx.buffers, self.n, self._kept
        if kept[0] == buffers.generation:
            buf, scr = kept[1](), kept[2]()
            if buf is not None and scr is not None:
                return (buf if len(buf) == n else buf[:n]), (scr if len(scr) == n else scr[:n])
        kind, dtype = self.group.adapter.kind, self.group.dtype
        buf, scr = buffers.host_whole(kind, dtype, n, "fused"), buffers.host_whole(kind, dtype, n, "recv")
        self._kept = (buffers.generation, weakref.ref(buf), weakref.ref(scr))
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
        the ranks disagree (nothing was sent; every rank must then explain), -4 where ``live`` is ``dst``
        and its tensors overlap (nothing was sent, nothing counted), or MPI's error code. An
        agreement still waiting after ``patience`` seconds (the stall inspector's) goes on in
        :func:`adasum.runtime.agreement.resume`, as the general path's does (``descs`` describe the call there), and
        the call then resumes where it stopped. Counted in ``compiled_calls`` however it ends."""
        ctx = self.ctx
        buf, scr = self._buffers()
        scratch = ctx.agree_scratch
        wait = waiting.policy(call.waiting)
        rc = _kernels.small_doubling(buf, scr, live, dst, self.span_array, self.program, digest, scratch, patience,
                                     *wait)
        if rc == -4:
            return rc
        if ctx.counters:
            ctx.record("compiled_calls", 1)
            ctx.record("scalar_bytes", AGREE_BYTES)
            ctx.record("collectives", 1)  # the agreement, made inside the compiled call
        if rc == -2:
            resume(call, "adasum", descs, patience)
            rc = _kernels.small_doubling(buf, scr, live, dst, self.span_array, self.program, digest, scratch, -1.0,
                                         *wait)
        if rc == 0 and ctx.counters:
            ctx.record("sent_bytes", self.messages * self.nbytes, self.messages)
        return rc

    def live(self, items: list) -> list:
        return items if len(self.layers) == self.count else [items[i] for i in self.layers]
