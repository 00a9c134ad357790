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
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..runtime import stall
from .agreement import agree
from .plan import Schedule

__all__ = ["FUSED_VOTE", "run_plain"]

# The vote of a rank that reduces sum/mean by the general path (one fused buffer per group).
FUSED_VOTE = 1
_SIXTEEN = ("float16", "bfloat16")


def run_plain(call, plan, items: list, single: bool, inplace: bool, op: str, extra: tuple):
    """Reduce ``items`` (the call's tensors, described by ``plan``, a sum or mean plan) and return what the
    call returns; None, before any communication, where this path does not take the call."""
    views = _host_views(call, plan, items, inplace)
    if views is None:
        return None
    fused = agree(call, op, plan.descs, None, extra=extra, digest=plan.signature) == FUSED_VOTE
    limit = 0 if fused else call.settings.plain_direct_bytes
    reqs, packed, outs, loose, direct = [], [], [None] * len(items), [], []
    comm = call.lcomm
    for g, group_views in zip(plan.groups, views):
        rest = []
        for i, v in zip(g.indices, group_views):
            if v.size == 0:
                outs[i] = v if inplace else v.copy()
            elif limit and v.nbytes >= limit:
                reqs.append(_direct(comm, v, inplace, outs, i, loose))
                direct.append(i)
            else:
                rest.append((i, v))
        if rest:
            reqs.append(_packed(call, g, rest, inplace, packed))
    call.record("allreduce_bytes", plan.nbytes)
    call.record("collectives", len(reqs))
    stall.wait(call, reqs, "exchange", plan.nbytes, label=f"a collective of {call.what}")
    if op == "mean":  # every reduced buffer once, before the copies out of the contiguous ones
        size = call.ctx.size
        for out in [outs[i] for i in direct] + [buf for buf, _ in packed]:
            np.divide(out, size, out=out)
    for tmp, dst in loose:  # non-contiguous in-place tensors, reduced in a contiguous copy
        dst[...] = tmp
    for buf, rest in packed:
        _unpack(buf, rest, inplace, outs)
    return _results(plan, items, single, inplace, outs)


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
            views = g.adapter.host_views(mine)
        elif g.adapter.kind == "numpy":
            views = mine
        else:
            return None
        if inplace and not all(v.flags.writeable for v in views):
            return None  # the general path names the read-only tensor on every rank
        out.append(views)
    return out


def _direct(comm, v: np.ndarray, inplace: bool, outs: list, i: int, loose: list) -> MPI.Request:
    """The allreduce of one tensor where it lies (a non-contiguous one through a contiguous copy)."""
    src = v if v.flags.c_contiguous else np.ascontiguousarray(v)
    if inplace:
        if src is not v:
            loose.append((src, v))
        outs[i] = src
        return comm.Iallreduce(MPI.IN_PLACE, src.reshape(-1), op=MPI.SUM)
    out = outs[i] = np.empty(v.shape, v.dtype)
    return comm.Iallreduce(src.reshape(-1), out.reshape(-1), op=MPI.SUM)


def _packed(call, g, rest: list, inplace: bool, packed: list) -> MPI.Request:
    """The allreduce of the group's smaller tensors ``rest`` ((index, view) pairs), packed into one buffer."""
    n = sum(v.size for _, v in rest)
    if inplace:
        buf = call.ctx.buffers.get("numpy", "cpu", g.dtype, n, "plain")
    else:
        buf = np.empty(n, g.dtype)
    np.concatenate([v.reshape(-1) for _, v in rest], out=buf)
    call.record("copied_bytes", buf.nbytes * (2 if inplace else 1))
    packed.append((buf, rest))
    return call.lcomm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)


def _unpack(buf: np.ndarray, rest: list, inplace: bool, outs: list) -> None:
    lo = 0
    for i, v in rest:
        piece = buf[lo:lo + v.size].reshape(v.shape)
        lo += v.size
        if inplace:
            v[...] = piece
            outs[i] = v
        else:
            outs[i] = piece


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
