"""The synchronous collectives of :mod:`adasum.horovod`, ``barrier()``, ``join()`` and the object calls.

Each is collective over its process set (default: the whole world) and starts with the negotiation of
:mod:`.negotiate`: where the ranks passed different things, or one found a problem, every rank raises
(a mismatch is an :class:`~adasum.AdasumMismatchError`: a ``ValueError`` and a ``HorovodInternalError``).
"""

from __future__ import annotations

import time

import torch
from mpi4py import MPI

from ..runtime import exchange, world
from . import plans
from .basics import HorovodInternalError
from .negotiate import RankCall, execute, serve_joined
from .facade import started
from .process_sets import resolve

__all__ = ["allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather", "grouped_allgather",
           "broadcast", "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter", "barrier", "join",
           "broadcast_object", "allgather_object"]


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set=None) -> torch.Tensor:
    """A new tensor: ``op`` over the set's ranks of ``tensor`` times ``prescale_factor``, the result times
    ``postscale_factor``; ``name`` is accepted and unused.

    ``op``: ``Average`` (the default), ``Sum``, ``Adasum`` (the library's), or ``Min``, ``Max``,
    ``Product`` (MPI's own reduction; 16-bit floats travel as float32, booleans as bytes). Integer tensors
    keep their dtype: scaled in float64 and cast back toward zero, their ``Average`` the sum divided by the
    size and cast back the same way, as in Horovod. ``compression``: ``Compression.fp16`` (or ``bf16``)
    sends floating tensors as 16-bit values with ``Sum``, ``Average`` and ``Adasum``.

    Differentiable with ``Sum`` and ``Average``: the backward is the same allreduce of the incoming
    gradient; every rank must run it. The other ops raise where ``tensor`` requires a gradient.
    """
    return plans.run(plans.allreduce(tensor, average, compression, op, prescale_factor, postscale_factor,
                                     process_set))


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set=None) -> torch.Tensor:
    """In place: :func:`allreduce` without compression, written into ``tensor``, which it returns."""
    with torch.no_grad():
        out = plans.run(plans.allreduce(tensor, average, None, op, prescale_factor, postscale_factor,
                                        process_set, grad=False))
        tensor.copy_(out)
    return tensor


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set=None) -> list[torch.Tensor]:
    """:func:`allreduce` of each tensor of ``tensors``, in one negotiation and one call of the library's
    allreduce (each tensor is a layer for ``Adasum``)."""
    return plans.run(plans.grouped_allreduce(tensors, average, compression, op, prescale_factor,
                                             postscale_factor, process_set))


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set=None) -> list[torch.Tensor]:
    """In place: :func:`grouped_allreduce` written into ``tensors``, which it returns."""
    with torch.no_grad():
        outs = plans.run(plans.grouped_allreduce(tensors, average, None, op, prescale_factor, postscale_factor,
                                                 process_set, grad=False))
        for t, o in zip(tensors, outs):
            t.copy_(o)
    return tensors


def allgather(tensor, name=None, process_set=None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0, in rank order; the ranks may differ in the
    size of dimension 0, not in the other dimensions or the dtype. Differentiable: this rank's gradient is
    its rows of the average over the ranks of the incoming gradient (as in Horovod)."""
    return plans.run(plans.allgather(tensor, process_set))


def grouped_allgather(tensors, name=None, process_set=None) -> list[torch.Tensor]:
    """:func:`allgather` of each tensor of ``tensors``, in one negotiation."""
    return plans.run(plans.grouped_allgather(tensors, process_set))


def broadcast(tensor, root_rank: int, name=None, process_set=None) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s ``tensor`` on every rank (the ranks pass the same shape and
    dtype; ``root_rank`` is a world rank in the set). Differentiable: the root's gradient is the average
    over the ranks of the incoming gradient, the other ranks' is zero (as in Horovod)."""
    return plans.run(plans.broadcast(tensor, root_rank, process_set))


def broadcast_(tensor, root_rank: int, name=None, process_set=None) -> torch.Tensor:
    """In place: ``root_rank``'s ``tensor`` written into every rank's ``tensor``, which it returns."""
    with torch.no_grad():
        out = plans.run(plans.broadcast(tensor, root_rank, process_set, grad=False))  # refuses a non-tensor
        tensor.copy_(out)
    return tensor


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Rank ``r`` receives ``splits[r]`` rows of every rank's ``tensor`` (the next rows in order), in rank
    order. ``splits``: an int32 tensor (or a list) of one count per rank of the set, adding up to at most
    ``tensor``'s first dimension; without it the first dimension is split evenly. Returns the rows received
    and, where ``splits`` is given, an int32 tensor of how many came from each rank. Differentiable."""
    return plans.run(plans.alltoall(tensor, splits, process_set))


def reducescatter(tensor, name=None, op=None, process_set=None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """``op`` (``Average`` by default, or ``Sum``, ``Min``, ``Max``, ``Product``; not ``Adasum``) over the
    set's ranks of ``tensor``, of which this rank keeps its share of the rows of dimension 0 (the first
    ``rows % size`` ranks one more). The whole tensor is reduced, then sliced. Differentiable."""
    return plans.run(plans.reducescatter(tensor, op, prescale_factor, postscale_factor, process_set))


def grouped_reducescatter(tensors, name=None, op=None, process_set=None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """:func:`reducescatter` of each tensor of ``tensors``, in one negotiation."""
    return plans.run(plans.grouped_reducescatter(tensors, op, prescale_factor, postscale_factor, process_set))


def _simple(kind: str, process_set, agree: tuple = (), local=None, error=None, run=lambda everyone: None):
    ps = resolve(process_set)
    return execute(ps.comm(), ps.ranks, world.rank(), RankCall(kind, agree, local, error), run)


def barrier(process_set=None) -> None:
    """Return once every rank of the set has called ``barrier()``."""
    _simple("barrier", process_set)


def broadcast_object(obj, root_rank: int = 0, name=None, process_set=None):
    """``root_rank``'s ``obj`` (pickled) on every rank of the set. ``name`` is accepted and unused."""
    ps = resolve(process_set)
    error = None
    if root_rank not in ps.ranks:
        error = ValueError, f"rank {world.rank()}: root_rank must be a rank of the process set {ps.ranks}, got {root_rank!r}"
    return _simple("broadcast_object", ps, (("root_rank", root_rank),), error=error,
                   run=lambda everyone: exchange.bcast(ps.comm(), obj, root=ps.ranks.index(root_rank),
                                                       what="broadcast_object"))


def allgather_object(obj, name=None, process_set=None) -> list:
    """Every rank's ``obj`` (pickled), in rank order. ``name`` is accepted and unused."""
    return _simple("allgather_object", process_set, local=obj, run=lambda everyone: [c.local for c in everyone])


def join(device=-1) -> int:
    """Wait until every rank has called ``join()``, answering meanwhile the other ranks' calls of this
    module: their ``allreduce``/``grouped_allreduce`` (op ``Sum``, ``Average`` or ``Adasum``; synchronous or
    asynchronous) with zeros, as Horovod does, so a rank that ran out of data can stop early (an
    ``Average`` still divides by the whole size). Any other call of the other ranks raises
    ``HorovodInternalError`` on them, and this rank goes on waiting. Returns the rank that joined last
    (the same on every rank). ``device`` is accepted and unused.

    Only the whole world's calls of :mod:`adasum.horovod` are answered: a joined rank takes no part in the
    library's own calls (``DistributedOptimizer``'s reductions, ``broadcast_parameters``) or in a process
    set's calls; against those every rank raises (a mismatch) or, for a process set, the others stall.
    Where this rank's ``join()`` raised so, its part on the handles' communicator is still waiting there:
    it answers the other ranks' next asynchronous allreduce with NaN (not zeros that would look valid) and
    their next asynchronous call after that by raising the failure; a ``join()`` of theirs ends it.
    """
    state = started()
    ps = resolve(None)
    start = time.monotonic()
    me = world.rank()
    box: dict = {}

    def on_stream() -> None:
        if state.absorbed:  # an abandoned join() met the other ranks' next join() on this communicator
            state.absorbed -= 1
            box["served"] = 0
            return
        box["served"], last = serve_joined(ps.comm(stream=True), ps.ranks, me, plans.answer_with_zeros,
                                           lambda: box.get("abandoned"))
        if "abandoned" in box and all(c.kind == "join" for c in last):
            state.absorbed += 1  # it used up the others' next join() here: this rank's next one skips it
    handle = state.lane.submit(_kept(on_stream, box))
    try:
        served, _ = serve_joined(ps.comm(), ps.ranks, me, plans.answer_with_zeros)
    except BaseException as exc:
        # The thread's part still waits for the others' asynchronous calls: it answers the next one by
        # raising this on the other ranks (never with zeros), and ends.
        box["abandoned"] = f"join() failed on this rank: {type(exc).__name__}: {exc}"
        raise
    handle.wait()
    error = box.get("error")
    waited = time.monotonic() - start
    mine = (served + box.get("served", 0), waited, None if error is None else f"{type(error).__name__}: {error}")
    everyone = exchange.allgather(None, mine, what="join's order")
    if error is not None:
        raise error
    failed = [f"rank {r}: {e}" for r, (_, _, e) in enumerate(everyone) if e is not None]
    if failed:
        raise HorovodInternalError(f"(raised on rank {me}) join() failed on other ranks: " + "; ".join(failed))
    return min(range(len(everyone)), key=lambda r: everyone[r][:2])


def _kept(fn, box: dict):
    """``fn`` for the communication thread, its error kept in ``box["error"]``."""
    def job() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - raised by join() on the calling thread
            box["error"] = exc
    return job

