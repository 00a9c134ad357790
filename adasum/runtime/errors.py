"""The errors a collective raises on every rank when the ranks did not take part in it alike: the base of
the stall inspector's, the agreement's and a dead rank's (:mod:`adasum.runtime.faults`). A leaf module, so
that the lowest floors of the runtime (the waits) may raise them."""

from __future__ import annotations

__all__ = ["AdasumCollectiveError", "AdasumStallError"]


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
