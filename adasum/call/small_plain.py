"""The compiled small plain call: a whole ``sum`` or ``mean`` of one host group as one call into the
compiled kernels (``_kernels.small_plain``), agreement included.

It takes exactly the calls for which :mod:`adasum.call.plain` would pack every tensor into one buffer
(one group, float32, float64 or integers, numpy arrays or torch CPU tensors, every tensor below the setting
``plain_direct_bytes``) and makes what that path makes for them: the agreement (the same four integers,
digest and vote), then one ``MPI_Iallreduce(SUM)`` of the group's elements in its MPI datatype, in place,
waited for by the one waiting rule (:mod:`adasum.runtime.waiting`) and, beyond the stall inspector's
patience, by the inspector itself; ``mean`` divides in the dtype as numpy does. Below the threshold the
vote cannot change what any rank posts (it only decides which tensors go to MPI where they lie, and here
none does), so ranks may take either path for the same call, bitwise alike. A plan may hold one
(:func:`small_plain_for`, when the plan is made); a call takes it (:meth:`SmallPlain.__call__`) under
the settings of :func:`adasum.schedules.small_call.allowed` when its tensors are contiguous and, in place,
do not overlap; otherwise :func:`adasum.call.plain.run_plain` runs it.
"""

from __future__ import annotations

import weakref

import numpy as np
from mpi4py import MPI

from ..kernels.native import compiled as _kernels  # None without a C compiler: SmallPlain is then never made
from ..kernels.native import handle, request
from ..rule.dtypes import FLOAT_DTYPES, INT_DTYPES, itemsize
from ..runtime import stall
from ..runtime.agreement import AGREE_BYTES, explain, resume, with_companion
from ..runtime.waiting import policy
from ..schedules.fusion import TensorLayout, layer_spans

__all__ = ["FUSED_VOTE", "SmallPlain", "small_plain_for"]

# The vote of a rank that reduces sum/mean with one fused buffer per group (the general path, and the
# plain path where a group's tensors lie back to back): the others then pack every tensor too.
FUSED_VOTE = 1
_DTYPES = FLOAT_DTYPES - {"float16", "bfloat16"} | INT_DTYPES  # integers for sum only (mean refuses them)
_HOST = (("numpy", "cpu"), ("torch", "cpu"))


def small_plain_for(call, op: str | None, one_group: bool, groups: list, count: int, descs, digest: int,
                    extra: tuple) -> "SmallPlain | None":
    """The compiled small plain call of a plan (``op``: "sum" or "mean" where the plan's schedule is
    MPI's allreduce, else None) of ``count`` tensors in ``groups``, or None where its calls cannot take it."""
    if op is None or _kernels is None or not one_group:
        return None
    g = groups[0]
    if g.dtype not in _DTYPES or (g.adapter.kind, g.device) not in _HOST or not 0 < g.size < 1 << 31:
        return None
    limit = call.settings.plain_direct_bytes  # part of the plan's key (extra), so the plan's own
    if limit and int(np.diff(g.bounds).max()) * itemsize(g.dtype) >= limit:
        return None  # some tensor would go to MPI where it lies
    return SmallPlain(call, g, op, count, descs, digest, extra)


class SmallPlain:
    """A plain (``sum``/``mean``) plan's calls as one compiled call each (see the module docstring): what
    stays the same between calls (the layers, the program with the MPI handles, the outputs' strides) is
    worked out once."""

    def __init__(self, call, group, op: str, count: int, descs, digest: int, extra: tuple):
        ctx = call.ctx
        self.ctx, self.group, self.op, self.descs, self.digest, self.extra = ctx, group, op, descs, digest, extra
        self.layers, _, self.span_array = layer_spans(group)
        self.all_live = len(self.layers) == count  # no empty tensors: the call's list is the live one
        self.n = group.size
        self.nbytes = self.n * itemsize(group.dtype)
        comm, int64, vmax = ctx.agree_handles
        dtype = np.dtype(group.dtype)
        # the datatype mpi4py gives numpy arrays of this dtype, as the Python path hands them to MPI
        self.program = np.array([comm, int64, vmax, handle(MPI._typedict[dtype.char]), handle(MPI.SUM),
                                 int(MPI.IN_PLACE), self.n, ctx.size if op == "mean" else 0,
                                 _ELEMENT.get(group.dtype, -1), ord(dtype.char), dtype.itemsize, FUSED_VOTE],
                                dtype=np.int64)
        self.torch = None
        if group.adapter.kind == "torch":
            torch = self.torch = group.adapter.torch
            self.torch_dtype = getattr(torch, group.dtype)
            # each output as a strided view of the call's one output tensor: (shape, strides, offset)
            self.strided = [(shape, _strides(shape), int(start)) for shape, start in zip(group.shapes, group.bounds)]
        self._kept: tuple = (-1, None)  # (generation, weak reference to the buffer) of the last in-place call
        self._wait: tuple = ("", ())  # (waiting mode, its policy)

    def _buffer(self) -> np.ndarray:
        """The context's buffer of :func:`adasum.call.plain.run_plain` (at least the group's size), which a
        call finds again (:attr:`_kept`) while the context's buffers stay the same; held weakly, so that
        this keeps no buffer alive."""
        buffers = self.ctx.buffers
        buf = buffers.host_whole("numpy", self.group.dtype, self.n, "plain")
        self._kept = (buffers.generation, weakref.ref(buf))
        return buf

    def __call__(self, call, items: list, single: bool, inplace: bool, patience: float):
        """The call ``call`` of ``items`` (the plan's tensors), whole, or None (before any communication)
        where its tensors cannot take it: not contiguous, read-only or overlapping in place."""
        found = self._operands(call, items, inplace)
        if found is None:
            return None
        digest, extra, parts, buf, out = found
        torch = self.torch
        how = self._wait
        if how[0] != call.waiting:
            how = self._wait = (call.waiting, policy(call.waiting))
        scratch, program, spans = self.ctx.agree_scratch, self.program, self.span_array
        try:
            rc, where = _kernels.small_plain(buf, parts, spans, program, digest, scratch, patience, 0, inplace,
                                             *how[1])
        except (BufferError, ValueError):  # not contiguous, or read-only in place: nothing was sent
            return None
        if rc == -4:
            return None  # in place on overlapping tensors: the Python path writes each result back in turn
        ctx = self.ctx
        if ctx.counters:
            ctx.record("compiled_calls", 1)
            ctx.record("scalar_bytes", AGREE_BYTES)
            ctx.record("collectives", 1)  # the agreement, made inside the compiled call
        if rc == -2:
            resume(call, self.op, self.descs, patience)
            rc, _ = _kernels.small_plain(buf, parts, spans, program, digest, scratch, patience, 1, inplace,
                                         *how[1])
        if rc == -3:
            self._resume_allreduce(call, patience)
            rc, _ = _kernels.small_plain(buf, parts, spans, program, digest, scratch, patience, 2, inplace,
                                         *how[1])
        if rc == -1:
            raise explain(call, self.op, self.descs, None, extra)
        if rc:
            raise MPI.Exception(rc)
        if ctx.counters:
            ctx.record("collectives", 1)
            ctx.record("allreduce_bytes", self.nbytes)
            if not (inplace and where == TensorLayout.ADJACENT):
                ctx.record("copied_bytes", self.nbytes * (2 if inplace else 1))
        if inplace:
            if torch is not None:
                self.group.adapter.wrote_parts(items)  # written through their addresses
            return items[0] if single else items
        if torch is not None:
            views = [out.as_strided(shape, strides, start) for shape, strides, start in self.strided]
        else:
            views = self.group.adapter.views(out, self.group.bounds, self.group.shapes)
        return views[0] if single else views

    def _operands(self, call, items: list, inplace: bool):
        """The digest (the companion's folded in), the extra settings, the tensors' addresses (or arrays), the
        buffer and the result's tensor (out of place) of one call; None where the call cannot take them."""
        digest, extra, companion = self.digest, self.extra, call.companion
        if companion is not None:  # a caller's agreement rides along (adasum.runtime.agreement.Companion)
            if companion.error is not None:
                return None  # the general path fails the call on every rank
            digest, _, extra = with_companion(call, digest, None, extra)
        live = items if self.all_live else [items[i] for i in self.layers]
        torch, out, buf = self.torch, None, None
        if torch is not None:  # the tensors' addresses: a fraction of what numpy views of them cost
            parts = self.group.adapter.addresses(live)
            if parts is None:
                return None
            if not inplace:
                out = torch.empty(self.n, dtype=self.torch_dtype)
                buf = out.data_ptr()
        else:
            parts = live
            if not inplace:
                buf = out = np.empty(self.n, self.group.dtype)
        if inplace:
            kept = self._kept
            buf = kept[1]() if kept[0] == self.ctx.buffers.generation else None
            if buf is None:
                buf = self._buffer()
        return digest, extra, parts, buf, out

    def _resume_allreduce(self, call, waited: float) -> None:
        """Go on waiting, through the stall inspector, for the allreduce the compiled call left waiting
        after ``waited`` seconds (its request in ``call.ctx.agree_scratch[8]``), as the Python path waits
        for it."""
        stall.wait(call, request(int(call.ctx.agree_scratch[8])), "exchange", self.nbytes, waited=waited,
                   label=f"a collective of {call.what}")


_ELEMENT = {"float32": 0, "float64": 1}  # the compiled kernels' element types (T_F32, T_F64; -1: integers)


def _strides(shape: tuple) -> tuple:
    """The strides, in elements, of a C-contiguous array of ``shape``."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))
