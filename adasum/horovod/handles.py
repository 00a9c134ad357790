"""The asynchronous calls of :mod:`adasum.horovod`: each returns a handle (an int) at once; the call runs on
the façade's communication thread (the lane of its state, :mod:`.facade`), over the handles' own duplicate of the set's
communicator, negotiated and stall-watched as the synchronous calls are. ``poll(handle)`` says whether it
finished; ``synchronize(handle)`` waits for it and returns its result or raises its error.

As in MPI, every rank of the set must make its asynchronous calls in the same order (Horovod's background
negotiation matches them by name instead). A ``name`` is in use from the call until ``synchronize()`` of
its handle: a second pending call with the same name raises ``ValueError`` on the rank that makes it. The
input tensors are read on the thread: leave them unchanged until ``synchronize()``. Asynchronous calls do
not track gradients.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..runtime import world
from . import plans
from .basics import Average, Sum
from .facade import FacadeState, current, started
from .process_sets import resolve

__all__ = ["allreduce_async", "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_",
           "allgather_async", "grouped_allgather_async", "broadcast_async", "broadcast_async_",
           "alltoall_async", "reducescatter_async", "grouped_reducescatter_async", "sparse_allreduce_async",
           "poll", "synchronize"]


class _Pending:
    __slots__ = ("job", "result", "error", "name")

    def __init__(self, name):
        self.job = None
        self.result = None
        self.error: BaseException | None = None
        self.name = name


def _submit(what: str, name, work: Callable[[], Any]) -> int:
    state = started()
    if name is not None and name in state.names:
        raise ValueError(f"rank {world.rank()}: {what}: the name {name!r} is in use by a call whose handle was "
                         "not synchronized yet; names of pending calls must differ")
    pending = _Pending(name)

    def job() -> None:
        try:
            with torch.no_grad():
                pending.result = work()
        except BaseException as exc:  # noqa: BLE001 - raised by synchronize()
            pending.error = exc
    pending.job = state.lane.submit(job)
    handle = next(state.handle_ids)
    state.pending[handle] = pending
    if name is not None:
        state.names.add(name)
    return handle


def _async(what: str, name, plan: plans.Collective, after: Callable[[Any], Any] | None = None) -> int:
    def work():
        out = plans.run(plan, stream=True)
        return after(out) if after is not None else out
    return _submit(what, name, work)


def poll(handle: int) -> bool:
    """Whether the call of ``handle`` has finished (``synchronize()`` then returns at once)."""
    return _pending(handle)[1].job.done.is_set()


def synchronize(handle: int):
    """Wait for the call of ``handle`` and return its result (raise its error); the handle is used up."""
    state, pending = _pending(handle)
    pending.job.wait()
    del state.pending[handle]
    state.names.discard(pending.name)
    if pending.error is not None:
        raise pending.error
    return pending.result


def _pending(handle) -> tuple[FacadeState, _Pending]:
    """The state holding ``handle``'s call, and the call."""
    state = current()
    try:
        return state, state.pending[handle]
    except (AttributeError, KeyError, TypeError):  # AttributeError: no state (before init(), after shutdown())
        raise ValueError(f"rank {world.rank()}: {handle!r} is not a handle of a pending call (each handle is "
                         "synchronized once)") from None


def _copy_into(tensors):
    def after(outs):
        for t, o in zip(tensors, outs):
            t.copy_(o)
        return tensors
    return after


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set=None, compression=None) -> int:
    """:func:`~.blocking.allreduce` on the communication thread; a handle."""
    return _async("allreduce_async", name, plans.allreduce(tensor, average, compression, op, prescale_factor,
                                                           postscale_factor, process_set, grad=False))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set=None) -> int:
    """:func:`allreduce_async` written into ``tensor`` (``synchronize`` returns it)."""
    plan = plans.allreduce(tensor, average, None, op, prescale_factor, postscale_factor, process_set, grad=False)
    return _async("allreduce_async_", name, plan, lambda out: _copy_into([tensor])([out])[0])


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set=None, compression=None) -> int:
    return _async("grouped_allreduce_async", name,
                  plans.grouped_allreduce(tensors, average, compression, op, prescale_factor, postscale_factor,
                                          process_set, grad=False))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set=None) -> int:
    plan = plans.grouped_allreduce(tensors, average, None, op, prescale_factor, postscale_factor, process_set,
                                   grad=False)
    return _async("grouped_allreduce_async_", name, plan, _copy_into(tensors))


def allgather_async(tensor, name=None, process_set=None) -> int:
    return _async("allgather_async", name, plans.allgather(tensor, process_set, grad=False))


def grouped_allgather_async(tensors, name=None, process_set=None) -> int:
    return _async("grouped_allgather_async", name, plans.grouped_allgather(tensors, process_set, grad=False))


def broadcast_async(tensor, root_rank: int, name=None, process_set=None) -> int:
    return _async("broadcast_async", name, plans.broadcast(tensor, root_rank, process_set, grad=False))


def broadcast_async_(tensor, root_rank: int, name=None, process_set=None) -> int:
    plan = plans.broadcast(tensor, root_rank, process_set, grad=False)
    return _async("broadcast_async_", name, plan, lambda out: _copy_into([tensor])([out])[0])


def alltoall_async(tensor, splits=None, name=None, process_set=None) -> int:
    return _async("alltoall_async", name, plans.alltoall(tensor, splits, process_set, grad=False))


def reducescatter_async(tensor, name=None, op=None, process_set=None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    return _async("reducescatter_async", name, plans.reducescatter(tensor, op, prescale_factor, postscale_factor,
                                                                   process_set, grad=False))


def grouped_reducescatter_async(tensors, name=None, op=None, process_set=None, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    return _async("grouped_reducescatter_async", name,
                  plans.grouped_reducescatter(tensors, op, prescale_factor, postscale_factor, process_set,
                                              grad=False))


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=None):
    """A sparse tensor's allreduce (``Sum`` or ``Average``) as Horovod does it: every rank's indices and
    values gathered (two allgathers on the communication thread), summed by coalescing. Returns a function
    that waits and gives the result (a sparse tensor), as Horovod's does."""
    ps = resolve(process_set)
    problem = None
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        problem = "sparse_allreduce_async takes a sparse torch tensor (torch.sparse_coo)"
    elif op not in (Sum, Average):
        problem = f"sparse_allreduce_async takes op Sum or Average, got {op!r}"
    if problem is not None:
        raise ValueError(f"rank {world.rank()}: {problem}")
    t = tensor.coalesce()
    indices = plans.allgather(t.indices().t().contiguous(), ps, grad=False)
    values = plans.allgather(t.values(), ps, grad=False)

    def work():
        idx = plans.run(indices, stream=True)
        val = plans.run(values, stream=True)
        out = torch.sparse_coo_tensor(idx.t(), val, t.shape).coalesce()
        return out / ps.size() if op == Average else out
    handle = _submit("sparse_allreduce_async", name, work)
    return lambda: synchronize(handle)

