"""Gradients of :mod:`adasum.horovod`'s collectives, as Horovod defines them. Each backward pass is itself a
collective of the façade on the same process set (negotiated, so every rank must run it where any does):

- ``allreduce``: the same allreduce of the incoming gradient (same op and scale factors);
- ``allgather``: the average over the ranks of the incoming gradient, this rank's rows of it;
- ``broadcast``: the average over the ranks of the incoming gradient on the root, zeros elsewhere;
- ``alltoall``: the incoming gradient sent back where its rows came from (rows never sent get zeros);
- ``reducescatter``: the incoming gradients gathered, times the set's size for ``Sum`` (times 1 for
  ``Average``) and times the scale factors.
"""

from __future__ import annotations

import torch

from ...runtime import world
from . import plans
from .basics import Average, Sum

__all__ = ["Allreduce", "GroupedAllreduce", "Allgather", "GroupedAllgather", "Broadcast", "Alltoall",
           "GroupedReducescatter"]


def _mine(ps) -> int:
    return ps.ranks.index(world.rank())


class Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, wire, prescale, postscale, ps):
        ctx.args = (op, wire, prescale, postscale, ps)
        return plans.transfer.reduce(tensor, op, wire, prescale, postscale, ps.comm())

    @staticmethod
    def backward(ctx, grad):
        op, wire, pre, post, ps = ctx.args
        out = plans.run(plans.allreduce(grad, op=op, compression=wire, prescale=pre, postscale=post, process_set=ps))
        return out, None, None, None, None, None


class GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, wire, prescale, postscale, ps, *tensors):
        ctx.args = (op, wire, prescale, postscale, ps)
        return tuple(plans.transfer.reduce_group(list(tensors), op, wire, prescale, postscale, ps.comm()))

    @staticmethod
    def backward(ctx, *grads):
        op, wire, pre, post, ps = ctx.args
        out = plans.run(plans.grouped_allreduce(list(grads), op=op, compression=wire, prescale=pre,
                                                postscale=post, process_set=ps))
        return (None,) * 5 + tuple(out)


def _average(grads: list[torch.Tensor], ps) -> list[torch.Tensor]:
    return plans.run(plans.grouped_allreduce(grads, op=Average, process_set=ps))


class Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, out, rows, ps):
        ctx.args = (rows, ps)
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, ps = ctx.args
        me = _mine(ps)
        start = sum(rows[:me])
        return _average([grad], ps)[0][start:start + rows[me]], None, None, None


class GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, ps, n, *tensors_and_outs):
        ctx.args = (rows, ps, n)
        return tuple(tensors_and_outs[n:])

    @staticmethod
    def backward(ctx, *grads):
        rows, ps, n = ctx.args
        me = _mine(ps)
        averaged = _average(list(grads), ps)
        mine = [g[sum(r[:me]):sum(r[:me]) + r[me]] for g, r in zip(averaged, rows)]
        return (None, None, None) + tuple(mine) + (None,) * n


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, out, root_rank, ps):
        ctx.args = (root_rank, ps)
        return out

    @staticmethod
    def backward(ctx, grad):
        root_rank, ps = ctx.args
        averaged = _average([grad], ps)[0]
        return (averaged if world.rank() == root_rank else torch.zeros_like(averaged)), None, None, None


class Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, out, send, recv, ps):
        ctx.args = (tensor.shape[0], recv, ps)
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, recv, ps = ctx.args
        back, _ = plans.run(plans.alltoall(grad, torch.tensor(recv, dtype=torch.int32), process_set=ps))
        if back.shape[0] < rows:
            back = torch.cat([back, back.new_zeros(rows - back.shape[0], *back.shape[1:])])
        return back, None, None, None, None


class GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, scale, ps, n, *tensors_and_outs):
        ctx.args = (op, scale, ps, n)
        return tuple(tensors_and_outs[n:])

    @staticmethod
    def backward(ctx, *grads):
        op, scale, ps, n = ctx.args
        gathered = plans.run(plans.grouped_allgather(list(grads), process_set=ps))
        factor = scale * (ps.size() if op == Sum else 1)
        return (None,) * 4 + tuple(g * factor if factor != 1 else g for g in gathered) + (None,) * n
