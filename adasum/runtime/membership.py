"""Who is in the world: the survivors' world after a rank died, and the world grown back with newcomers.

A wait that meets a dead rank revokes every communicator of the library and raises
:class:`~adasum.runtime.faults.WorldChanged` on every survivor (:mod:`adasum.runtime.faults`).
:func:`shrink` then makes the smaller world (``MPI_Comm_shrink`` of the current one) and makes it the
*current world*: the default communicator of every call that takes ``comm=None`` (:func:`world`). The
contexts of the old communicators are abandoned, never freed (freeing a revoked communicator may wait for
dead ranks); their next call raises at once. Where elastic training starts processes in place of the dead
(:mod:`adasum.runtime.growth`), :func:`adopt` makes the world they joined current in the same way, on the
survivors and on the newcomers. State of the library that is one per process (the Horovod façade's lane and
process sets) follows through :func:`when_world_changes`. :func:`note_whereabouts` keeps every rank's host
and process id, so that after a stall timeout :func:`kill_silent` can end a rank that stopped answering
(a stopped process never takes part in a shrink, and is reported dead only once it is killed).

Where the MPI has no ULFM, :func:`ulfm_problem` says why and what to do; nothing here changes how a failure
ends the job there.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import signal

from mpi4py import MPI

from .context import live_contexts
from .faults import (WorldChanged, is_failure, is_revoked, replace_world, revoke_all, ulfm_problem,
                     world)

__all__ = ["WorldChanged", "lost_ranks", "world", "replace_world", "ulfm_problem", "is_failure", "is_revoked",
           "revoke_all", "shrink", "adopt", "when_world_changes", "when_shrunk", "note_whereabouts", "kill_silent"]

# Seconds MPI_Finalize may take at exit once ranks died before this process ends without it.
FINALIZE_PATIENCE = 10.0
_listeners: list = []  # called, in order, after the world shrank or grew (when_world_changes)
# (the world they were gathered on, [(host, pid) of each of its ranks]): note_whereabouts
_whereabouts: list = [None, []]
_watched: list = []  # the world this process started with, once _finalize_or_leave is registered


def when_world_changes(fn) -> None:
    """Call ``fn()`` after every :func:`shrink` and :func:`adopt`, once the new world is current
    (collective there, newcomers included): for state of the library that is one per process, such as
    :mod:`adasum.horovod`'s lane and process sets."""
    _listeners.append(fn)


when_shrunk = when_world_changes  # its first name, from when the world could only shrink


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
    old = world()
    revoke_all()
    new = old.Shrink()
    for ctx in live_contexts():
        if is_revoked(ctx.user_comm):
            ctx.abandon("a rank died and the world shrank; this communicator is revoked")
    new.Set_name(f"the survivors' world ({new.Get_size()} ranks)")
    _finalize_watched(old)
    replace_world(new)
    for fn in _listeners:
        fn()
    return new


def lost_ranks(old_group: MPI.Group, new: MPI.Intracomm) -> list[int]:
    """The ranks of the world whose group is ``old_group`` that the world ``new`` lacks (after a shrink:
    the dead), in that old world's numbering; local."""
    try:
        gone = MPI.Group.Difference(old_group, new.Get_group())
        try:
            return [int(r) for r in MPI.Group.Translate_ranks(gone, list(range(gone.Get_size())), old_group)]
        finally:
            gone.Free()
    except MPI.Exception:
        return []


def adopt(new: MPI.Intracomm, why: str) -> None:
    """Make ``new`` (the survivors' world merged with the processes started in place of the dead, on every
    one of them) the current world: the contexts on the old one abandoned (``why`` is what their next call
    says; the old world is neither revoked nor freed: a process started in place of a dead one may have
    failed to join, and freeing may wait for it), then the functions of :func:`when_world_changes`
    (collective over ``new``)."""
    old = world()
    for ctx in live_contexts():
        if ctx.user_comm == old:
            ctx.abandon(why)
    new.Set_name(f"the world grown back ({new.Get_size()} ranks)")
    _finalize_watched(old)
    replace_world(new)
    for fn in _listeners:
        fn()


def _finalize_watched(old: MPI.Intracomm) -> None:
    """The first time the world changes in this process (``old`` is the world it started with): finalize
    under a watchdog at exit (:func:`_finalize_or_leave`)."""
    if not _watched:
        _watched.append(old)
        atexit.register(_finalize_or_leave)


def note_whereabouts(gather) -> None:
    """Keep the host and process id of every rank of the current world, ``gather(obj)`` being an allgather
    over it (collective): what :func:`kill_silent` needs to end a rank that stopped answering."""
    _whereabouts[:] = [world(), gather((MPI.Get_processor_name(), os.getpid()))]


def kill_silent(exc) -> list[int]:
    """After a stall timeout (``exc``, an :class:`~adasum.runtime.errors.AdasumStallError` naming the ranks
    nobody heard from): SIGKILL those of them that run on this host, so that MPI reports them dead and the
    survivors can shrink the world without them (a stopped or hung process never takes part in the
    shrink). Returns the ranks of the current world it killed. Only where :func:`note_whereabouts` has
    noted the current world; a rank on another host is left to a waiting rank on its own host."""
    comm, silent = getattr(exc, "comm", None), getattr(exc, "silent", None)
    noted, places = _whereabouts
    if not silent or comm is None or noted is None or noted != world() or not places:
        return []
    try:
        ranks = MPI.Group.Translate_ranks(comm.Get_group(), silent, world().Get_group())
    except MPI.Exception:
        return []
    host, me, killed = MPI.Get_processor_name(), os.getpid(), []
    for rank in ranks:
        if rank == MPI.UNDEFINED or not 0 <= rank < len(places):
            continue
        where, pid = places[rank]
        if where == host and pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(rank)
            except (ProcessLookupError, PermissionError):
                pass
    return killed
