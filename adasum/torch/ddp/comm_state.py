"""What both DDP hook states share: the lane (a duplicate of the communicator and the thread that reduces
the buckets while backward goes on) and the futures DDP waits for."""

# No ``from __future__ import annotations`` here: DDP checks the hooks' return annotation as an object.
import functools
import weakref

import torch
from mpi4py import MPI

from ...runtime.context import check_comm
from ...runtime.lane import Lane

__all__ = ["CommState"]


class CommState:
    """A hook state's lane (:class:`~adasum.runtime.lane.Lane`: a duplicate of ``comm`` and the thread that
    reduces the buckets), ended with the state (or by :meth:`close`). Pickles (and copies) without it,
    making no collective call (as torch's hook states drop their process group): a state unpickled or
    copied reduces over the library's duplicate of the current world (``MPI.COMM_WORLD``, or the survivors'
    communicator after an elastic shrink: :func:`adasum.runtime.faults.world`), looked up at the first
    reduction, which every rank makes in its first hook call (the library makes that duplicate, where it
    does not exist yet, collectively and watched by the stall inspector)."""

    def __init__(self, comm: MPI.Intracomm | None, overlap: bool = True):
        comm = check_comm(comm)
        self.overlap = bool(overlap)
        self._start(comm, owned=True)

    def _start(self, comm: MPI.Intracomm | None, owned: bool) -> None:
        # the futures given to the lane and not completed yet: failed if the lane ends before their job ran
        self._pending: dict[int, torch.futures.Future] = {}
        self._lane = Lane(comm, "adasum-ddp-hook", owned=owned, threaded=None if self.overlap else False,
                          on_end=functools.partial(_fail_pending, self._pending))
        weakref.finalize(self, self._lane.drop, "the DDP hook state that owned this communicator was dropped")

    @property
    def comm(self) -> MPI.Intracomm:
        return self._lane.comm

    @property
    def closed(self) -> bool:
        return self._lane.closed

    def close(self) -> None:
        """End the communication thread, once it has run the buckets already given to it, and free the
        communicator; the hook raises afterwards. Call it on every rank after a ``backward()`` (DDP has
        waited for every bucket then); a state that is collected ends the same way without waiting for a
        collective."""
        self._lane.close()

    def abandon(self, why: str = "the hook state was abandoned") -> None:
        """End without a collective (the world changed under it: its communicator may be revoked, and the
        other ranks may never enter a collective there): the communication thread and the communicator are
        dropped, the hook raises afterwards saying ``why``. Local; :class:`adasum.torch.elastic.ElasticDDP`
        calls it before it makes a new state on the new world."""
        self._lane.drop(why)

    def _submit(self, buffer: torch.Tensor, work) -> torch.futures.Future[torch.Tensor]:
        """``work()`` reduces a bucket: run it on the lane and return a future of ``buffer`` that it completes
        (with the error ``work`` raised, if it did); or run it here, where the lane is not threaded, and
        return a completed future."""
        lane = self._lane
        if lane.closed:
            raise RuntimeError(f"rank {lane.rank}: this {type(self).__name__} was closed; "
                               "register a new state on a new model")
        if not lane.threaded:
            work()
            return _done(buffer)
        fut = _future(buffer)
        error: list = []
        self._pending[id(fut)] = fut
        lane.submit(_job(self._pending, fut, buffer, work, error), "a DDP bucket's reduction")
        # DDP reads the future from C++: a callback that raises marks the future it returns as failed there
        # (a Python future's set_exception is a result that DDP would try to read as the bucket's tensor).
        return fut.then(_raising(error))

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_lane", None)
        state.pop("_pending", None)
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("overlap", True)  # a state pickled before the hooks overlapped
        self.__dict__.pop("_comm", None)
        self._start(None, owned=False)


def _fail_pending(pending: dict) -> None:
    """Last, once no bucket runs: fail the futures whose job never ran."""
    futures = list(pending.values())
    pending.clear()
    for fut in futures:
        if not fut.done():  # its job never ran: the future's callback raises
            fut.set_exception(RuntimeError("the DDP hook state was closed or dropped before this bucket's "
                                           "reduction ran"))


def _raising(error: list):
    """The callback of a bucket's future: its tensor, or the error its reduction raised. The error is kept
    apart from the first future (in ``error``), so that nothing the error refers to (its traceback's
    frames) refers back to that future: a cycle through a future is never collected, and would keep the
    state, and its thread, alive."""
    def then(fut: torch.futures.Future) -> torch.Tensor:
        if error:
            raise error.pop()
        return fut.value()
    return then


def _job(pending: dict, fut: torch.futures.Future, buffer: torch.Tensor, work, error: list):
    def job() -> None:
        nonlocal work
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - through the future: backward() raises it
            error.append(e)
        finally:
            work = None  # before the future completes: nothing on the thread holds the state afterwards
        pending.pop(id(fut), None)
        fut.set_result(buffer)
    return job


def _future(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    return torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)


def _done(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut = _future(buffer)
    fut.set_result(buffer)
    return fut
