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
    """A call waited ``stall_timeout`` seconds for ranks that did not enter it; the text names them."""
