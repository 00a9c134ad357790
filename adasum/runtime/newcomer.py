"""A newcomer: a process that elastic training started (``MPI_Comm_spawn``) in place of a rank that died.

The survivors start it with the job's command line and mark it with ``ADASUM_ELASTIC_NEWCOMER`` (the
seconds it has to join) in its environment (:mod:`adasum.runtime.growth`). It runs the script from the
top while the survivors wait, and joins them only in ``adasum.torch.elastic.run``. Until then its world
(:func:`adasum.runtime.faults.world`, the default communicator of every call) is a world of its own, of
one rank (:func:`first_world`): ``adasum.size()`` is 1, ``adasum.rank()`` 0, objects built on it (a
``DistributedOptimizer``) are rebuilt on the joined world, and the library's collectives on it raise
:class:`~adasum.runtime.errors.AdasumNotJoinedError` (the others cannot meet it there: they wait in
``run``). ``MPI.COMM_WORLD`` of a newcomer holds the newcomers started together, not the job.

At import a newcomer tells the survivors that it is alive (:func:`announce`); one that has not joined
within its time (a script stuck before ``run``) ends itself, so that it never keeps the job from ending
(:func:`arm`).

A leaf of the runtime: it imports only numpy and mpi4py, so that :mod:`adasum.runtime.faults` can make its world.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading

import numpy as np
from mpi4py import MPI

from ..settings import launch_environment

__all__ = ["ENV", "is_newcomer", "parent", "first_world", "pending", "joined", "arm", "disarm", "leave",
           "announce"]

ENV = "ADASUM_ELASTIC_NEWCOMER"
TAG_ALIVE = 7301  # the newcomer's first word to the survivors (adasum.runtime.growth: the others)
HOST_BYTES = 256
# Seconds a newcomer is given beyond the survivors' wait before it ends itself (arm).
GRACE = 10.0


class _Newcomer:
    """This process's part as a newcomer: the survivors' intercommunicator, its world until it joins, the
    timer that ends it if it never joins."""

    def __init__(self) -> None:
        self.parent: MPI.Intercomm | None = None
        self.placeholder: MPI.Intracomm | None = None
        self.timer: threading.Timer | None = None
        self.seconds = 0.0
        self.sent: list = []  # the announcement's buffer, once sent
        value = launch_environment().get(ENV)
        if not value or not MPI.Is_initialized():
            return
        try:
            parent = MPI.Comm.Get_parent()
        except MPI.Exception:
            return
        if parent == MPI.COMM_NULL:  # the variable alone (a user's own launch): not a newcomer
            return
        self.parent = parent
        self.seconds = _seconds(value)
        self.placeholder = MPI.COMM_SELF.Dup()
        self.placeholder.Set_name("this newcomer's own world (it has not joined the job yet)")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        return 300.0
    return value if value > 0 else 300.0


_me = _Newcomer()


def is_newcomer() -> bool:
    """Whether elastic training started this process in place of a rank that died."""
    return _me.parent is not None


def parent() -> MPI.Intercomm | None:
    """The intercommunicator to the survivors that started this process (None where it is no newcomer)."""
    return _me.parent


def first_world() -> MPI.Intracomm:
    """The world at import: ``MPI.COMM_WORLD``, or a newcomer's own world of one rank until it joins."""
    return _me.placeholder if _me.placeholder is not None else MPI.COMM_WORLD


def pending() -> MPI.Intracomm | None:
    """A newcomer's own world while it has not joined (the library refuses collectives there); else None."""
    return _me.placeholder


def joined() -> None:
    """The newcomer is part of the job now: its own world is no longer pending."""
    _me.placeholder = None


def arm() -> None:
    """Start the timer that ends this newcomer where it has not joined within the survivors' wait (the
    seconds of ``ADASUM_ELASTIC_NEWCOMER``) and :data:`GRACE`: it would keep the job from ending."""
    if _me.parent is None or _me.timer is not None:
        return
    _me.timer = threading.Timer(_me.seconds + GRACE, leave,
                                args=(f"it did not join the job within {_me.seconds + GRACE:.0f} s",))
    _me.timer.daemon = True
    _me.timer.start()


def disarm() -> None:
    """The newcomer joined: its timer stops."""
    if _me.timer is not None:
        _me.timer.cancel()


def leave(why: str) -> None:
    """End this newcomer at once (SIGKILL, so that Open MPI reports it dead rather than waiting for its
    MPI_Finalize), saying why on stderr."""
    print(f"adasum: newcomer (pid {os.getpid()}) started to replace a rank that died: {why}; it ends",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _exit_unjoined() -> None:
    """At exit, a newcomer that never joined (its script failed before ``run``) ends at once: its
    MPI_Finalize would wait for the survivors, who are connected to it."""
    if _me.placeholder is not None:
        leave("its script ended before it joined the job")


def announce() -> None:
    """Tell every survivor that this newcomer is alive, with its process id and host (a survivor on its
    host can then see it die before it joins: :mod:`adasum.runtime.growth`)."""
    parent = _me.parent
    if parent is None or _me.sent:
        return
    buf = np.zeros(8 + HOST_BYTES, dtype=np.uint8)
    buf[:8] = np.array([os.getpid()], dtype=np.int64).view(np.uint8)
    host = MPI.Get_processor_name().encode()[:HOST_BYTES]
    buf[8:8 + len(host)] = np.frombuffer(host, dtype=np.uint8)
    _me.sent = [buf]
    # Waited for: nothing else makes progress in MPI here before run, and until it does, the first message to
    # a process of another job (a connection to make) may never leave. The survivors are receiving.
    MPI.Request.Waitall([parent.Isend(buf, dest=r, tag=TAG_ALIVE) for r in range(parent.Get_remote_size())])


arm()
announce()
if _me.parent is not None:
    atexit.register(_exit_unjoined)
