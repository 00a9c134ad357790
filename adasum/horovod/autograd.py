"""Gradients of :mod:`adasum.horovod`'s collectives, as Horovod defines them. Each backward pass is itself a
collective of the façade on the same process set (negotiated, so every rank must run it where any does):

- ``allreduce``: the same allreduce of the incoming gradient (same op and scale factors);
- ``allgather``: the average over the ranks of the incoming gradient, this rank's rows of it;
- ``broadcast``: the average over the ranks of the incoming gradient on the root, zeros elsewhere;
- ``alltoall``: the incoming gradient sent back where its rows came from (rows never sent get zeros);
- ``reducescatter``: the incoming gradients gathered, times the set's size for ``Sum`` (times 1 for
  ``Average``) and times the scale factors.

The collective a backward pass runs is made by the plan builder of :mod:`.plans` that the forward call
passes in (``allreduce``, ``grouped_allreduce``, ``grouped_allgather`` or ``alltoall``), and run with
:func:`.negotiate.run`; this module imports neither the builders nor anything that imports them.
"""

from __future__ import annotations

import torch

from ..runtime import world
from . import transfer
from .basics import Average, Sum
from .negotiate import run

__all__ = ["Allreduce", "GroupedAllreduce", "Allgather", "GroupedAllgather", "Broadcast", "Alltoall",
           "GroupedReducescatter"]


def _mine(ps) -> int:
    return ps.ranks.index(world.rank())


class Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, wire, prescale, postscale, ps, allreduce):
        ctx.args = (op, wire, prescale, postscale, ps, allreduce)
        return transfer.reduce(tensor, op, wire, prescale, postscale, ps.comm())

    @staticmethod
    def backward(ctx, grad):
        op, wire, pre, post, ps, allreduce = ctx.args
        out = run(allreduce(grad, op=op, compression=wire, prescale=pre, postscale=post, process_set=ps))
        return out, None, None, None, None, None, None


class GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, wire, prescale, postscale, ps, grouped_allreduce, *tensors):
        ctx.args = (op, wire, prescale, postscale, ps, grouped_allreduce)
        return tuple(transfer.reduce_group(list(tensors), op, wire, prescale, postscale, ps.comm()))

    @staticmethod
    def backward(ctx, *grads):
        op, wire, pre, post, ps, grouped_allreduce = ctx.args
        out = run(grouped_allreduce(list(grads), op=op, compression=wire, prescale=pre, postscale=post,
                                    process_set=ps))
        return (None,) * 6 + tuple(out)


def _average(grads: list[torch.Tensor], ps, grouped_allreduce) -> list[torch.Tensor]:
    return run(grouped_allreduce(grads, op=Average, process_set=ps))


def _own_rows(grads: list[torch.Tensor], rows, ps, grouped_allreduce) -> list[torch.Tensor]:
    """An allgather's backward: each output's gradient averaged over the ranks, then the rows this rank
    contributed (``rows[i]``: every rank's row count in output i)."""
    me = _mine(ps)
    averaged = _average(grads, ps, grouped_allreduce)
    return [g[sum(r[:me]):sum(r[:me]) + r[me]] for g, r in zip(averaged, rows)]


class _RanAlready(torch.autograd.Function):
    """A collective of one tensor whose result ``out`` was computed before: forward hands it on and keeps
    what the backward needs (``arg``: an allgather's row counts, a broadcast's root)."""

    @staticmethod
    def forward(ctx, tensor, out, arg, ps, grouped_allreduce):
        ctx.args = (arg, ps, grouped_allreduce)
        return out


class Allgather(_RanAlready):
    @staticmethod
    def backward(ctx, grad):
        rows, ps, grouped_allreduce = ctx.args
        return _own_rows([grad], [rows], ps, grouped_allreduce)[0], None, None, None, None


class GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, ps, grouped_allreduce, n, *tensors_and_outs):
        ctx.args = (rows, ps, grouped_allreduce, n)
        return tuple(tensors_and_outs[n:])

    @staticmethod
    def backward(ctx, *grads):
        rows, ps, grouped_allreduce, n = ctx.args
        return (None,) * 4 + tuple(_own_rows(list(grads), rows, ps, grouped_allreduce)) + (None,) * n


class Broadcast(_RanAlready):
    @staticmethod
    def backward(ctx, grad):
        root_rank, ps, grouped_allreduce = ctx.args
        averaged = _average([grad], ps, grouped_allreduce)[0]
        return (averaged if world.rank() == root_rank else torch.zeros_like(averaged)), None, None, None, None


class Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, out, send, recv, ps, alltoall):
        ctx.args = (tensor.shape[0], recv, ps, alltoall)
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, recv, ps, alltoall = ctx.args
        back, _ = run(alltoall(grad, torch.tensor(recv, dtype=torch.int32), process_set=ps))
        if back.shape[0] < rows:
            back = torch.cat([back, back.new_zeros(rows - back.shape[0], *back.shape[1:])])
        return back, None, None, None, None, None


class GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, scale, ps, grouped_allgather, n, *tensors_and_outs):
        ctx.args = (op, scale, ps, grouped_allgather, n)
        return tuple(tensors_and_outs[n:])

    @staticmethod
    def backward(ctx, *grads):
        op, scale, ps, grouped_allgather, n = ctx.args
        gathered = run(grouped_allgather(list(grads), process_set=ps))
        factor = scale * (ps.size() if op == Sum else 1)
        return (None,) * 5 + tuple(g * factor if factor != 1 else g for g in gathered) + (None,) * n
