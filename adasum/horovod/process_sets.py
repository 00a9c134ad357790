"""Initialisation and process sets of :mod:`adasum.horovod`.

``init()`` (collective) makes the façade's lane (:class:`adasum.runtime.lane.Lane`): a second communicator,
a duplicate of the world on which the asynchronous calls run, and the communication thread that runs them
(its waits nap, :mod:`adasum.runtime.waiting`). The synchronous calls run on the calling thread over the
world's communicator; the two never share a communicator, so a pending handle never meets a call of the
main thread.

A :class:`ProcessSet` is a sub-communicator of each of the two: ``add_process_set(ranks)`` is collective
over the world (every rank calls it with the same ranks, as in Horovod) and splits both; the split of the
handles' communicator runs on the communication thread, after the handles already given to it.
"""

from __future__ import annotations

import atexit
import itertools
from typing import Callable, Iterable

from mpi4py import MPI

from ..runtime import world
from ..runtime.context import library_comm
from ..runtime.elastic import when_shrunk
from ..runtime.elastic import world as world_comm
from ..runtime.lane import Lane
from .negotiate import RankCall, execute

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "init", "shutdown",
           "initialized", "ensure", "on_thread", "thread", "resolve", "rejoin"]


class _State:
    stream: MPI.Intracomm | None = None  # the world's duplicate for the handles
    thread: Lane | None = None  # the handles' lane
    ids = itertools.count(1)
    sets: dict = {}
    reinit = False  # a shrink must call init() again (one that did died with a rank)


class ProcessSet:
    """A subset of the world's ranks on which collectives run (Horovod's ``hvd.ProcessSet``): pass it as
    ``process_set=`` to a collective or to ``DistributedOptimizer``. ``ranks`` are world ranks, sorted;
    ``process_set_id`` is set once it is registered by :func:`add_process_set` (0: the whole world)."""

    def __init__(self, ranks: Iterable[int]):
        self.ranks = sorted(int(r) for r in ranks)
        self.process_set_id: int | None = None
        self._main: MPI.Intracomm | None = None
        self._stream: MPI.Intracomm | None = None

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
        if stream:
            ensure()
        return self._stream if stream else self._main

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet(range(world.size()))
global_process_set.process_set_id = 0
global_process_set._main = MPI.COMM_WORLD


def initialized() -> bool:
    return _State.stream is not None


def init(comm=None, process_sets=None) -> None:
    """Collective over the world: find the node layout (so that ``local_rank()``, ``local_size()``,
    ``cross_rank()`` and ``cross_size()`` are local calls after it, as in Horovod), make the handles'
    communicator and thread (once), then register ``process_sets`` (a list of :class:`ProcessSet`), as
    Horovod's ``init(process_sets=...)``."""
    if comm is not None:
        raise ValueError("adasum.horovod.init supports only the whole world (comm=None); use "
                         "process_sets= or add_process_set() for subsets, or pass comm= to adasum's own API")
    if _State.stream is None:
        world.local_rank()  # the node layout, found collectively here: local_rank() and the others are local after
        # the handles' lane: its own duplicate of the world and the thread that runs them (its waits nap)
        _State.thread = Lane(world_comm(), "adasum-horovod", threaded=True, may_give_up=False)
        stream = _State.stream = _State.thread.comm
        global_process_set._stream = stream
        atexit.register(_finish)
    for ps in process_sets or ():
        add_process_set(ps)


def ensure() -> None:
    """Raise where ``init()`` was not called: the asynchronous calls, ``join()`` and process sets need the
    handles' communicator, which ``init()`` makes (collectively: it cannot be made by the first such call,
    which other ranks may not be making)."""
    if _State.stream is None:
        raise ValueError(f"rank {world.rank()}: adasum.horovod has not been initialized; call hvd.init() first "
                         "(on every rank)")


def _finish() -> None:
    """At exit: let the thread run the handles it was given (MPI is finalised after this)."""
    if _State.thread is not None:
        _State.thread.close()


def shutdown() -> None:
    """Run the handles already given, end the thread and free the communicators; ``init()`` may follow."""
    if _State.stream is None:
        return
    for ps in list(_State.sets.values()):
        _free(ps)
    _State.sets.clear()
    _finish()  # the lane frees its communicator
    _State.stream = _State.thread = None
    global_process_set._stream = None


def thread() -> Lane:
    ensure()
    return _State.thread


def on_thread(fn: Callable[[], object]) -> object:
    """Run ``fn`` on the communication thread, after the handles given before; its result, or its error."""
    box: dict = {}

    def job() -> None:
        try:
            box["out"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised on the calling thread
            box["error"] = exc

    thread().submit(job).wait()
    if "error" in box:
        raise box["error"]
    return box.get("out")


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
    ensure()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    call = RankCall("add_process_set", agree=(("ranks", tuple(ps.ranks)),), error=_problem(ps))
    execute(world_comm(), global_process_set.ranks, world.rank(), call, lambda everyone: None)
    me = world.rank()
    color = 0 if me in ps.ranks else MPI.UNDEFINED
    main = library_comm(world_comm()).Split(color, me)
    stream = on_thread(lambda: _State.stream.Split(color, me))
    ps._main = None if main == MPI.COMM_NULL else main
    ps._stream = None if stream == MPI.COMM_NULL else stream
    ps.process_set_id = next(_State.ids)
    _State.sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` and free its communicators. Collective over the world. Returns True."""
    ensure()
    problem = None
    if not isinstance(process_set, ProcessSet) or process_set.process_set_id not in _State.sets:
        problem = (ValueError, f"rank {world.rank()}: {process_set!r} is not a registered process set (the "
                               "global one cannot be removed)")
    pid = getattr(process_set, "process_set_id", None)
    call = RankCall("remove_process_set", agree=(("process_set_id", pid),), error=problem)
    execute(world_comm(), global_process_set.ranks, world.rank(), call, lambda everyone: None)
    _free(_State.sets.pop(pid))
    return True


def rejoin() -> None:
    """After the world shrank (:mod:`adasum.runtime.elastic`): the registered process sets dropped (their
    communicators were revoked; register them again), the handles' lane dropped, the global set made of the
    new world, and, where ``init()`` had been called, ``init()`` again (collective over the new world). A
    rank that dies during that ``init()`` leaves the need for it standing: the next shrink calls it again."""
    was = _State.stream is not None or _State.reinit
    _State.reinit = was
    for ps in _State.sets.values():
        ps._main = ps._stream = None
        ps.process_set_id = None
    _State.sets.clear()
    if _State.thread is not None:
        _State.thread.drop("the world shrank")
    _State.stream = _State.thread = None
    global_process_set.ranks = list(range(world.size()))
    global_process_set._main = world_comm()
    global_process_set._stream = None
    if was:
        init()
    _State.reinit = False


when_shrunk(rejoin)


def _free(ps: ProcessSet) -> None:
    if ps._main is not None:
        ps._main.Free()
    if ps._stream is not None:
        stream = ps._stream
        on_thread(stream.Free)
    ps._main = ps._stream = None
    ps.process_set_id = None
