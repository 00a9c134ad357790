"""The errors a collective raises on every rank when the ranks did not take part in it alike: the base of
the stall inspector's, the agreement's and a dead rank's (:mod:`adasum.runtime.faults`). A leaf module, so
that the lowest floors of the runtime (the waits) may raise them."""

from __future__ import annotations

__all__ = ["AdasumCollectiveError", "AdasumStallError", "AdasumNotJoinedError", "NOT_JOINED"]


class AdasumCollectiveError(RuntimeError):
    """A collective failed between the ranks: they called different things (:class:`AdasumMismatchError`),
    a rank did not arrive (:class:`AdasumStallError`) or died (:class:`~adasum.runtime.faults.WorldChanged`).
    ``adasum.horovod.HorovodInternalError`` is this class, so ``except hvd.HorovodInternalError`` catches
    them all, as Horovod's scripts expect."""


class AdasumStallError(AdasumCollectiveError):
    """A call waited ``stall_timeout`` seconds for ranks that did not enter it; the text names them.

    Attributes:
        silent: the ranks (of ``comm``) that nobody heard from: they had not entered the call; None where
            the error does not come from a wait that timed out (a communicator given up).
        comm: the communicator those ranks belong to.
    """

    def __init__(self, *args, silent: list[int] | None = None, comm=None):
        super().__init__(*args)
        self.silent = silent
        self.comm = comm


class AdasumNotJoinedError(RuntimeError):
    """A collective of the library in a process that elastic training started in place of a rank that died,
    before it joined the job in ``adasum.torch.elastic.run``: the others wait for it there, and would never
    meet it in this call (:mod:`adasum.runtime.newcomer`)."""


# What a newcomer's collectives before it joined say (adasum.runtime.context refuses them).
NOT_JOINED = ("this process was started in place of a rank that died and has not joined the job yet: it joins "
              "in adasum.torch.elastic.run, where the others wait for it, so no collective can meet it before; "
              "communicate inside the elastic training function (State.sync() there brings rank 0's state), or "
              "skip it where adasum.torch.elastic.is_newcomer()")
