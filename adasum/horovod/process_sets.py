"""Initialisation and process sets of :mod:`adasum.horovod`.

``init()`` (collective) makes the façade's state (:mod:`.facade`) and its lane: a second communicator, a
duplicate of the world on which the asynchronous calls run, and the communication thread that runs them. The
synchronous calls run on the calling thread over the world's communicator; the two never share a
communicator, so a pending handle never meets a call of the main thread.

A :class:`ProcessSet` is a subset of the world's ranks; once registered, the state holds its
sub-communicator of each of the two: ``add_process_set(ranks)`` is collective over the world (every rank
calls it with the same ranks, as in Horovod) and splits both; the split of the handles' communicator runs on
the communication thread, after the handles already given to it. ``global_process_set`` is the whole current
world (the survivors' after a rank died), registered always, with ``process_set_id`` 0.
"""

from __future__ import annotations

from typing import Iterable

from mpi4py import MPI

from ..runtime import world
from ..runtime.context import library_comm
from ..runtime.membership import world as world_comm
from ..runtime.newcomer import pending
from .facade import Registered, current, install, started, uninstall
from .negotiate import RankCall, execute

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "init", "shutdown",
           "is_initialized", "resolve"]


class ProcessSet:
    """A subset of the world's ranks on which collectives run (Horovod's ``hvd.ProcessSet``): pass it as
    ``process_set=`` to a collective or to ``DistributedOptimizer``. ``ranks`` are world ranks, sorted;
    ``process_set_id`` is set once it is registered by :func:`add_process_set` (0: the whole world), and
    None again once it is removed (or the world changed)."""

    def __init__(self, ranks: Iterable[int]):
        self.ranks = sorted(int(r) for r in ranks)
        self.process_set_id: int | None = None

    def size(self) -> int:
        return len(self.ranks)

    def included(self) -> bool:
        return world.rank() in self.ranks

    def rank(self) -> int:
        """This rank's index in the set; ValueError where it is not in the set."""
        if not self.included():
            raise ValueError(f"rank {world.rank()} is not in the process set {self.ranks}")
        return self.ranks.index(world.rank())

    def comm(self, stream: bool = False) -> MPI.Intracomm:
        """The set's communicator: of the main thread, or (``stream``) of the handles' thread."""
        if self.process_set_id is None:
            raise ValueError(f"rank {world.rank()}: the process set {self.ranks} is not registered: "
                             "call hvd.add_process_set() with it first (on every rank)")
        if not self.included():
            raise ValueError(f"rank {world.rank()} is not in the process set {self.ranks}: only its ranks "
                             "call collectives on it")
        entry = started().sets[self.process_set_id]
        return entry.stream if stream else entry.main

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _World(ProcessSet):
    """The whole current world: its ranks and its communicator are read at each call (never at import), so it
    follows the world after a rank died; the handles' communicator is the lane's."""

    def __init__(self) -> None:  # no ranks kept: they are the current world's
        self.process_set_id = 0

    @property
    def ranks(self) -> list[int]:
        return list(range(world.size()))

    def included(self) -> bool:
        return True

    def comm(self, stream: bool = False) -> MPI.Intracomm:
        return started().lane.comm if stream else world_comm()


global_process_set = _World()


def is_initialized() -> bool:
    """Whether ``init()`` was called (and the façade's lane is up: after a rank died, once it is made again)."""
    state = current()
    return state is not None and state.started


def init(comm=None, process_sets=None) -> None:
    """Collective over the world: find the node layout (so that ``local_rank()``, ``local_size()``,
    ``cross_rank()`` and ``cross_size()`` are local calls after it, as in Horovod), make the façade's state
    with the handles' communicator and thread (once), then register ``process_sets`` (a list of
    :class:`ProcessSet`), as Horovod's ``init(process_sets=...)``. In a process that elastic training started
    in place of a dead rank (:mod:`adasum.runtime.newcomer`) only the state is made: the rest follows when it
    joins the job in ``hvd.elastic.run``, and ``local_rank()`` or a process set before that raises."""
    if comm is not None:
        raise ValueError("adasum.horovod.init supports only the whole world (comm=None); use "
                         "process_sets= or add_process_set() for subsets, or pass comm= to adasum's own API")
    state = install()
    if not state.started and pending() is None:  # a newcomer's lane is made once it joined (facade._rejoin)
        state.start()
    for ps in process_sets or ():
        add_process_set(ps)


def shutdown() -> None:
    """Run the handles already given, end the thread and free the communicators; the handles not synchronized
    are gone. ``init()`` may follow."""
    uninstall()


def resolve(process_set) -> ProcessSet:
    """``process_set`` (None: the whole world), checked."""
    if process_set is None:
        return global_process_set
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be an adasum.horovod.ProcessSet, got {type(process_set).__name__}")
    return process_set


def _problem(ps: ProcessSet) -> tuple | None:
    size = world.size()
    if not ps.ranks or any(r < 0 or r >= size for r in ps.ranks) or len(set(ps.ranks)) != len(ps.ranks):
        return ValueError, f"rank {world.rank()}: a process set needs distinct ranks of 0..{size - 1}, got {ps.ranks}"
    if ps.process_set_id is not None:
        return ValueError, f"rank {world.rank()}: {ps!r} is registered already"
    return None


def add_process_set(process_set) -> ProcessSet:
    """Register a process set (a :class:`ProcessSet` or a list of world ranks) and return it. Collective
    over the world: every rank calls it with the same ranks (ValueError on every rank otherwise)."""
    state = started()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    call = RankCall("add_process_set", agree=(("ranks", tuple(ps.ranks)),), error=_problem(ps))
    execute(world_comm(), global_process_set.ranks, world.rank(), call, lambda everyone: None)
    me = world.rank()
    color = 0 if me in ps.ranks else MPI.UNDEFINED
    main = library_comm(world_comm()).Split(color, me)
    lane = state.lane.comm
    stream = state.on_lane(lambda: lane.Split(color, me))
    ps.process_set_id = next(state.set_ids)
    state.sets[ps.process_set_id] = Registered(ps, None if main == MPI.COMM_NULL else main,
                                               None if stream == MPI.COMM_NULL else stream)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` and free its communicators. Collective over the world. Returns True."""
    state = started()
    pid = getattr(process_set, "process_set_id", None)
    problem = None
    if not isinstance(process_set, ProcessSet) or pid not in state.sets:
        problem = (ValueError, f"rank {world.rank()}: {process_set!r} is not a registered process set (the "
                               "global one cannot be removed)")
    call = RankCall("remove_process_set", agree=(("process_set_id", pid),), error=problem)
    execute(world_comm(), global_process_set.ranks, world.rank(), call, lambda everyone: None)
    state.unregister(pid)
    return True
