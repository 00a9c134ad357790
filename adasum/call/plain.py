"""``sum`` and ``mean`` of host tensors at the cost of MPI's own allreduce.

The general path packs every group into one fused buffer, reduces it and writes it back: two copies of
every byte, which cost more than the allreduce itself from a few MiB on. Here a tensor of at least
``plain_direct_bytes`` goes to MPI as it lies (in place, or from the input into the new output), and only
the smaller ones are packed into one buffer per dtype, where one message is cheaper than many. The messages
a call makes follow from what the ranks agree on (the shapes, the dtypes, the op and the threshold, all in
the digest), and the agreement's vote says whether some rank could not take this path (device or staged
buffers, 16-bit floats): then every rank packs every tensor, as the general path does, so the ranks always
post the same collectives in the same order.

Torch CPU tensors are reduced through numpy views of their memory (kept between calls by the adapter), so
they cost what numpy arrays of the same bytes cost.

Where every tensor is below the threshold (one float32 or float64 group), the compiled small plain call
(:mod:`adasum.call.small_plain`) makes the same collectives in one call into the compiled kernels; this
path takes what it leaves.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..adapters.host import divide_in_place
from ..kernels.native import compiled
from ..runtime import stall
from ..runtime.agreement import agree
from .plan import Schedule
from .small_plain import FUSED_VOTE

__all__ = ["FUSED_VOTE", "run_plain"]
_SIXTEEN = ("float16", "bfloat16")


def run_plain(call, plan, items: list, single: bool, inplace: bool, op: str, extra: tuple):
    """Reduce ``items`` (the call's tensors, described by ``plan``, a sum or mean plan) and return what the
    call returns; None, before any communication, where this path does not take the call."""
    views = _host_views(call, plan, items, inplace)
    if views is None:
        return None
    whole = _whole_views(call.ctx.adapters.of("numpy"), plan, items, views) if inplace else None
    fused = agree(call, op, plan.descs, None, extra=extra, digest=plan.signature,
                  vote=0 if whole is None else FUSED_VOTE) == FUSED_VOTE
    limit = 0 if fused else call.settings.plain_direct_bytes
    comm, reqs, reduced, after, loose = call.lcomm, [], [], [], []
    outs: list = [None] * len(items)
    for j, (g, mine) in enumerate(zip(plan.groups, views)):
        if fused and whole is not None:  # back to back in one block: reduced there, nothing copied
            reqs.append(comm.Iallreduce(MPI.IN_PLACE, whole[j], op=MPI.SUM))
            reduced.append(whole[j])
            outs = items
            continue
        direct, rest, empty, spans, n = _split(g, limit)
        for k in empty:
            outs[g.indices[k]] = mine[k] if inplace else mine[k].copy()
        for k in direct:
            reqs.append(_direct(comm, mine[k], inplace, outs, g.indices[k], reduced, loose))
        if rest:
            buf = call.ctx.buffers.get("numpy", "cpu", g.dtype, n, "plain") if inplace else np.empty(n, g.dtype)
            part = [mine[k] for k in rest]
            _copy(buf, part, spans)
            call.record("copied_bytes", buf.nbytes * (2 if inplace else 1))
            reqs.append(comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM))
            reduced.append(buf)
            after.append((buf, part, spans, [g.indices[k] for k in rest]))
    call.record("allreduce_bytes", plan.nbytes)
    call.record("collectives", len(reqs))
    stall.wait(call, reqs, "exchange", plan.nbytes, label=f"a collective of {call.what}")
    if op == "mean":  # every reduced buffer once, before the copies out of the contiguous ones
        for out in reduced:
            divide_in_place(out, call.ctx.size)
    for tensor, copy in loose:  # non-contiguous tensors, reduced in a contiguous copy
        tensor[...] = copy
    for buf, part, spans, indices in after:
        if inplace:
            _copy(part, buf, spans)
            for i, v in zip(indices, part):
                outs[i] = v
        else:
            for i, v, (lo, hi) in zip(indices, part, spans.tolist()):
                outs[i] = buf[lo:hi].reshape(v.shape)
    return _results(plan, items, single, inplace, outs)


def _whole_views(numpy_adapter, plan, items: list, views) -> list | None:
    """Per group, one flat view of its tensors where every group's tensors lie back to back in one block
    of memory, else None. A rank whose tensors do votes for one message per group (the fused vote), which
    it then makes without a copy."""
    if compiled is None:
        return None
    out = []
    for g, mine in zip(plan.groups, views):
        if g.adapter.kind == "torch":  # torch knows which tensors share a storage
            view = g.adapter.fused_view([items[i] for i in g.indices])
            view = None if view is None else view.detach().numpy()
        else:
            try:
                if compiled.layout(mine, True) != 2:  # 2: back to back, in order
                    return None
            except (BufferError, ValueError, TypeError):  # not contiguous, or read-only
                return None
            view = numpy_adapter.fused_view(mine, adjacent=True)
        if view is None or len(view) != g.size:
            return None
        out.append(view)
    return out


def _split(g, limit: int) -> tuple[list[int], list[int], list[int], np.ndarray, int]:
    """The group's non-empty layers that go to MPI where they lie (``limit`` bytes and more; 0: none), the
    others, the empty ones, the spans of the others in the packed buffer and its length; kept with the
    plan's group."""
    key = ("plain", limit)
    out = g.memo.get(key)
    if out is None:
        item = np.dtype(g.dtype).itemsize
        sizes = np.diff(g.bounds).tolist()
        direct = [k for k, n in enumerate(sizes) if n and limit and n * item >= limit]
        rest = [k for k, n in enumerate(sizes) if n and k not in direct]
        empty = [k for k, n in enumerate(sizes) if not n]
        ends = np.cumsum([sizes[k] for k in rest], dtype=np.int64)
        spans = np.stack([ends - [sizes[k] for k in rest], ends], axis=1) if rest else np.zeros((0, 2), np.int64)
        out = g.memo[key] = (direct, rest, empty, spans, int(ends[-1]) if rest else 0)
    return out


def _copy(dst, src, spans: np.ndarray) -> None:
    """``dst[s:e] = src[s:e]`` per span, one side a flat buffer and the other the tensors, by the compiled
    kernels where they take the dtype and the tensors are contiguous, else by numpy."""
    if compiled is not None:
        try:
            compiled.copy(dst, src, spans)
            return
        except (BufferError, ValueError, TypeError):
            pass
    if isinstance(dst, np.ndarray):
        np.concatenate([v.reshape(-1) for v in src], out=dst[:int(spans[-1, 1])])
        return
    for v, (lo, hi) in zip(dst, spans.tolist()):
        v[...] = src[lo:hi].reshape(v.shape)


def _host_views(call, plan, items: list, inplace: bool) -> list | None:
    """Per group, numpy views of its tensors' memory; None where a group is not on the host, is 16-bit,
    goes through staging buffers, or (in place) cannot be written."""
    if call.settings.gpu_transport == "staged" or plan.schedule not in (Schedule.SUM, Schedule.MEAN):
        return None
    out = []
    for g in plan.groups:
        if g.dtype in _SIXTEEN or g.device != "cpu":
            return None
        mine = [items[i] for i in g.indices]
        if g.adapter.kind == "torch":
            try:
                views = g.adapter.host_views(mine)  # torch's memory is always writable
            except (TypeError, RuntimeError):  # a tensor without memory of its own (sparse, found with the
                return None  # plan of dense ones): the general path says what is wrong
        elif g.adapter.kind == "numpy":
            views = mine
            if inplace and not all(v.flags.writeable for v in views):
                return None  # the general path names the read-only tensor on every rank
        else:
            return None
        out.append(views)
    return out


def _direct(comm, v: np.ndarray, inplace: bool, outs: list, i: int, reduced: list, loose: list) -> MPI.Request:
    """The allreduce of one tensor where it lies (a non-contiguous one through a contiguous copy)."""
    src = v if v.flags.c_contiguous else np.ascontiguousarray(v)
    if inplace:
        if src is not v:
            loose.append((v, src))
        reduced.append(src)
        outs[i] = v
        return comm.Iallreduce(MPI.IN_PLACE, src.reshape(-1), op=MPI.SUM)
    out = outs[i] = np.empty(v.shape, v.dtype)
    reduced.append(out)
    return comm.Iallreduce(src.reshape(-1), out.reshape(-1), op=MPI.SUM)


def _results(plan, items: list, single: bool, inplace: bool, outs: list):
    if inplace:
        for g in plan.groups:
            if g.adapter.kind == "torch":
                g.adapter.wrote_parts([items[i] for i in g.indices])  # written through numpy views
        return items[0] if single else items
    for g in plan.groups:
        if g.adapter.kind == "torch":
            torch = g.adapter.torch
            for i in g.indices:
                outs[i] = torch.from_numpy(outs[i])
    return outs[0] if single else outs
