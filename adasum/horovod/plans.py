"""Each collective of :mod:`adasum.horovod` as a :class:`~.negotiate.Collective`: the process set, this rank's
side of the negotiation (:class:`~.negotiate.RankCall`, with the problems found locally) and what runs once
every rank agreed (:func:`~.negotiate.run` runs it). The synchronous calls run a plan on the calling
thread over the set's communicator; the asynchronous ones on the communication thread over the handles'
communicator (:mod:`.handles`)."""

from __future__ import annotations

import torch
from mpi4py import MPI

from ..runtime import world
from . import autograd as ag
from . import transfer
from .basics import Adasum, Average, Max, Min, MPI_OPS, OPS, Sum, wire_of
from .negotiate import RankCall, Collective, run
from .process_sets import resolve

__all__ = ["Collective", "run", "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
           "alltoall", "reducescatter", "grouped_reducescatter", "answer_with_zeros"]


def _problem(tensors, what: str, dims: int = 0) -> tuple | None:
    """(ValueError, why) where an element of ``tensors`` is not a torch tensor of at least ``dims``
    dimensions, else None."""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            return ValueError, (f"rank {world.rank()}: the tensor argument is a "
                                f"{type(t).__module__}.{type(t).__qualname__}, not a torch.Tensor")
        if t.dim() < dims:
            return ValueError, f"rank {world.rank()}: {what} needs tensors of at least {dims} dimension(s), got 0-d"
    return None


def _tracks(tensors, grad: bool) -> bool:
    return grad and torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _layout(tensors, trailing: bool = False) -> tuple:
    """(dtype, shape) of each tensor (shape without dimension 0 where ``trailing``), for the agreement."""
    if any(not isinstance(t, torch.Tensor) for t in tensors):
        return ()
    return tuple((str(t.dtype), tuple(t.shape[1:] if trailing else t.shape)) for t in tensors)


def _op(average, op, what: str) -> tuple[str | None, tuple | None]:
    if average is not None:
        if op is not None:
            return None, (ValueError, f"rank {world.rank()}: pass either average= or op=, not both")
        op = Average if average else Sum
    op = Average if op is None else op
    if op not in OPS:
        return None, (ValueError, f"rank {world.rank()}: op must be one of Average, Sum, Adasum, Min, "
                                  f"Max, Product, got {op!r}")
    return op, None


def _reduction(tensors, average, op, compression, grad: bool, what: str):
    """(op, wire, tracks gradients, problem) of a reduction's arguments."""
    op, error = _op(average, op, what)
    wire, refused = wire_of(compression)
    error = error or _problem(tensors, what) or ((ValueError, f"rank {world.rank()}: {refused}") if refused else None)
    track = error is None and _tracks(tensors, grad)
    if error is None and wire is not None and (op in MPI_OPS or not all(t.is_floating_point() for t in tensors)):
        error = ValueError, (f"rank {world.rank()}: compression applies to floating tensors with Sum, Average or "
                             f"Adasum, not op={op!r} on {[str(t.dtype) for t in tensors]}")
    if error is None and op in (Min, Max) and any(t.is_complex() for t in tensors):
        error = ValueError, f"rank {world.rank()}: op={op!r} is not defined for complex tensors"
    if error is None and track and op not in (Sum, Average):
        error = ValueError, (f"rank {world.rank()}: {what} with op={op!r} has no gradient here (only Sum and "
                             "Average do): detach the tensor or use Sum/Average")
    return op, wire, track, error


def allreduce(tensor, average=None, compression=None, op=None, prescale: float = 1.0, postscale: float = 1.0,
              process_set=None, grad: bool = True) -> Collective:
    ps = resolve(process_set)
    op, wire, track, error = _reduction([tensor], average, op, compression, grad, "allreduce")
    call = RankCall("allreduce", (("op", op), ("compression", wire), ("tensors", _layout([tensor])),
                              ("requires_grad", track)), error=error, joinable=op in (Sum, Average, Adasum))
    pre, post = float(prescale), float(postscale)

    def go(everyone, comm):
        if track:
            return ag.Allreduce.apply(tensor, op, wire, pre, post, ps, allreduce)
        return transfer.reduce(tensor, op, wire, pre, post, comm)
    return Collective(ps, call, go)


def grouped_allreduce(tensors, average=None, compression=None, op=None, prescale: float = 1.0,
                      postscale: float = 1.0, process_set=None, grad: bool = True) -> Collective:
    ps = resolve(process_set)
    tensors = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
    op, wire, track, error = _reduction(tensors, average, op, compression, grad, "grouped_allreduce")
    call = RankCall("grouped_allreduce", (("op", op), ("compression", wire), ("tensors", _layout(tensors)),
                                      ("requires_grad", track)), error=error, joinable=op in (Sum, Average, Adasum))
    pre, post = float(prescale), float(postscale)

    def go(everyone, comm):
        if track:
            return list(ag.GroupedAllreduce.apply(op, wire, pre, post, ps, grouped_allreduce, *tensors))
        return transfer.reduce_group(tensors, op, wire, pre, post, comm)
    return Collective(ps, call, go)


def answer_with_zeros(call: RankCall, comm: MPI.Intracomm, fill: float = 0.0) -> None:
    """A joined rank's part in a joinable ``call`` of the other ranks: zeros (or ``fill`` where the dtype
    holds it) of their dtypes and shapes."""
    a = dict(call.agree)
    zeros = []
    for dtype, shape in a["tensors"]:
        dtype = getattr(torch, dtype.replace("torch.", ""))
        zeros.append(torch.full(shape, fill if dtype.is_floating_point else 0, dtype=dtype))
    transfer.reduce_group(zeros, a["op"], a["compression"], 1.0, 1.0, comm)


def _rows(call_locals: list, i: int | None = None) -> list[int]:
    return [c.local if i is None else c.local[i] for c in call_locals]


def allgather(tensor, process_set=None, grad: bool = True) -> Collective:
    ps = resolve(process_set)
    error = _problem([tensor], "allgather", dims=1)
    track = error is None and _tracks([tensor], grad)
    call = RankCall("allgather", (("tensors", _layout([tensor], trailing=True)), ("requires_grad", track)),
                local=tensor.shape[0] if error is None else 0, error=error)

    def go(everyone, comm):
        rows = _rows(everyone)
        out = transfer.allgatherv(tensor, rows, comm)
        return ag.Allgather.apply(tensor, out, rows, ps, grouped_allreduce) if track else out
    return Collective(ps, call, go)


def grouped_allgather(tensors, process_set=None, grad: bool = True) -> Collective:
    ps = resolve(process_set)
    tensors = list(tensors)
    error = _problem(tensors, "grouped_allgather", dims=1)
    track = error is None and _tracks(tensors, grad)
    call = RankCall("grouped_allgather", (("tensors", _layout(tensors, trailing=True)), ("requires_grad", track)),
                local=[t.shape[0] for t in tensors] if error is None else [], error=error)

    def go(everyone, comm):
        rows = [_rows(everyone, i) for i in range(len(tensors))]
        outs = [transfer.allgatherv(t, r, comm) for t, r in zip(tensors, rows)]
        return (list(ag.GroupedAllgather.apply(rows, ps, grouped_allreduce, len(tensors), *tensors, *outs)) if track
                else outs)
    return Collective(ps, call, go)


def broadcast(tensor, root_rank: int, process_set=None, grad: bool = True) -> Collective:
    ps = resolve(process_set)
    error = _problem([tensor], "broadcast")
    if error is None and root_rank not in ps.ranks:
        error = ValueError, (f"rank {world.rank()}: root_rank must be a rank of the process set {ps.ranks}, "
                             f"got {root_rank!r}")
    track = error is None and _tracks([tensor], grad)
    call = RankCall("broadcast", (("root_rank", root_rank), ("tensors", _layout([tensor])), ("requires_grad", track)),
                error=error)

    def go(everyone, comm):
        out = transfer.bcast(tensor, ps.ranks.index(root_rank), comm)
        return ag.Broadcast.apply(tensor, out, root_rank, ps, grouped_allreduce) if track else out
    return Collective(ps, call, go)


def _splits(tensor, splits, n: int) -> tuple[list[int] | None, tuple | None]:
    """The rows to send to each of ``n`` ranks, or a problem."""
    me = world.rank()
    if splits is None:
        if tensor.shape[0] % n:
            return None, (ValueError, f"rank {me}: alltoall without splits needs a first dimension that is a "
                                      f"multiple of the number of ranks ({n}), got {tensor.shape[0]}")
        return [tensor.shape[0] // n] * n, None
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            return None, (ValueError, f"rank {me}: alltoall's splits must be a tensor of int32, got {splits.dtype}")
        splits = splits.tolist()
    splits = [int(s) for s in splits]
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) > tensor.shape[0]:
        return None, (ValueError, f"rank {me}: alltoall's splits must be {n} non-negative counts adding up to at "
                                  f"most the first dimension ({tensor.shape[0]}), got {splits}")
    return splits, None


def alltoall(tensor, splits=None, process_set=None, grad: bool = True) -> Collective:
    ps = resolve(process_set)
    error = _problem([tensor], "alltoall", dims=1)
    send = None
    if error is None:
        send, error = _splits(tensor, splits, ps.size())
    track = error is None and _tracks([tensor], grad)
    call = RankCall("alltoall", (("tensors", _layout([tensor], trailing=True)), ("requires_grad", track)),
                local=send, error=error)

    def go(everyone, comm):
        me = comm.Get_rank()
        recv = [c.local[me] for c in everyone]
        out = transfer.alltoallv(tensor, send, recv, comm)
        if track:
            out = ag.Alltoall.apply(tensor, out, send, recv, ps, alltoall)
        received = torch.tensor(recv, dtype=torch.int32)
        return out if splits is None else (out, received)
    return Collective(ps, call, go)


def scatter_rows(rows: int, n: int) -> list[int]:
    """Rows of each of ``n`` ranks in a reducescatter of ``rows`` rows: the first ``rows % n`` get one more."""
    return [rows // n + (1 if r < rows % n else 0) for r in range(n)]


def _reducescatter_args(tensors, op, what: str):
    op, error = _op(None, op, what)
    error = error or _problem(tensors, what, dims=1)
    if error is None and op == Adasum:
        error = NotImplementedError, (f"rank {world.rank()}: {what} does not take op=Adasum (Adasum combines "
                                      "whole vectors): use allreduce with op=Adasum")
    return op, error


def reducescatter(tensor, op=None, prescale: float = 1.0, postscale: float = 1.0, process_set=None,
                  grad: bool = True) -> Collective:
    plan = grouped_reducescatter([tensor], op, prescale, postscale, process_set, grad, what="reducescatter")
    return Collective(plan.ps, plan.call, lambda everyone, comm: plan.run(everyone, comm)[0])


def grouped_reducescatter(tensors, op=None, prescale: float = 1.0, postscale: float = 1.0, process_set=None,
                          grad: bool = True, what: str = "grouped_reducescatter") -> Collective:
    ps = resolve(process_set)
    tensors = list(tensors)
    op, error = _reducescatter_args(tensors, op, what)
    track = error is None and _tracks(tensors, grad)
    call = RankCall(what, (("op", op), ("tensors", _layout(tensors)), ("requires_grad", track)), error=error)
    pre, post = float(prescale), float(postscale)

    def go(everyone, comm):
        full = transfer.reduce_group(tensors, op, None, pre, post, comm)
        outs = []
        for t in full:
            counts = scatter_rows(t.shape[0], comm.Get_size())
            start = sum(counts[:comm.Get_rank()])
            outs.append(t[start:start + counts[comm.Get_rank()]].clone())
        if track:
            return list(ag.GroupedReducescatter.apply(op, pre * post, ps, grouped_allgather, len(tensors), *tensors,
                                                      *outs))
        return outs
    return Collective(ps, call, go)
