"""What :mod:`adasum.horovod` keeps between calls, in one object: :class:`FacadeState`.

``hvd.init()`` makes it (:func:`install`, then :meth:`FacadeState.start`, collective over the world) and
``hvd.shutdown()`` closes it (:func:`uninstall`); this module's ``_state`` is the one reference to it, and
nothing here calls MPI before ``init()``. It holds:

- the handles' lane (:class:`adasum.runtime.lane.Lane`): a duplicate of the world on which the asynchronous
  calls run, and the communication thread that runs them (its waits nap, :mod:`adasum.runtime.waiting`);
- the registered process sets and their two communicators each (of the calling thread, of the lane);
- the pending handles of the asynchronous calls and the names in use by them;
- ``join()``'s count of abandoned joins that the other ranks' next ``join()`` ended on the lane;
- the 16-bit wires of the collectives' ``compression``, one per thread (each keeps its 16-bit buffer, and one
  reduction at a time runs on a wire: the calling thread's and the lane's never meet).

Without ``init()`` the synchronous calls keep nothing: they run on the current world
(:func:`adasum.runtime.membership.world`) and make a wire per call.

After the world changed (it shrank, or grew back: :func:`adasum.runtime.membership.when_world_changes`,
collective over the new world) the state's parts of the old world go (:meth:`FacadeState.drop_world`: the
lane, the process sets, ``join()``'s count) and the lane is made again on the new world
(:meth:`FacadeState.start`). A rank that dies meanwhile leaves the state without a lane
(``is_initialized()`` is False); the next change starts it again. The pending handles stay: each holds its
call's error (the lane was dropped), which ``synchronize()`` raises.
"""

from __future__ import annotations

import atexit
import itertools
import threading
from typing import Any, Callable, NamedTuple

from mpi4py import MPI

from ..runtime import world
from ..runtime.membership import when_world_changes
from ..runtime.membership import world as world_comm
from ..runtime.lane import Lane
from ..torch.window.compress import Wire

__all__ = ["FacadeState", "Registered", "current", "started", "install", "uninstall", "wire"]


class Registered(NamedTuple):
    """A registered process set (``ps``) and its communicators: ``main`` of the calling thread, ``stream`` of
    the lane (None where this rank is not in the set)."""

    ps: Any
    main: MPI.Intracomm | None
    stream: MPI.Intracomm | None


class FacadeState:
    """Everything :mod:`adasum.horovod` keeps between calls (the module docstring)."""

    def __init__(self) -> None:
        self.lane: Lane | None = None
        self.sets: dict[int, Registered] = {}
        self.set_ids = itertools.count(1)
        self.pending: dict[int, Any] = {}  # handle: its call (adasum.horovod.handles)
        self.names: set = set()  # the names of the pending calls
        self.handle_ids = itertools.count(1)
        self.absorbed = 0  # abandoned join()s on the lane's communicator that ended with the others' join()
        self._wires = threading.local()
        atexit.register(self.close_lane)  # before MPI is finalised: let the lane run the handles it was given

    def start(self) -> None:
        """Collective over the world: find the node layout (``local_rank()`` and the others are local after
        it), then make the lane: its own duplicate of the world and the thread that runs the handles."""
        world.local_rank()
        self.lane = Lane(world_comm(), "adasum-horovod", threaded=True, may_give_up=False)

    @property
    def started(self) -> bool:
        return self.lane is not None

    def on_lane(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the lane's thread, after the handles given before; its result, or its error."""
        box: dict = {}

        def job() -> None:
            try:
                box["out"] = fn()
            except BaseException as exc:  # noqa: BLE001 - raised on the calling thread
                box["error"] = exc

        self.lane.submit(job).wait()
        if "error" in box:
            raise box["error"]
        return box.get("out")

    def wire(self, name: str) -> Wire:
        """This thread's wire ``name`` (``"fp16"``, ``"bf16"``), kept for its next calls."""
        kept = getattr(self._wires, name, None)
        if kept is None:
            kept = Wire(name)
            setattr(self._wires, name, kept)
        return kept

    def free_sets(self) -> None:
        """Free every registered set's communicators (the lane's on the lane, after the handles given)."""
        for entry in list(self.sets.values()):
            self.unregister(entry.ps.process_set_id)

    def unregister(self, pid: int) -> None:
        entry = self.sets.pop(pid)
        if entry.main is not None:
            entry.main.Free()
        if entry.stream is not None:
            self.on_lane(entry.stream.Free)
        entry.ps.process_set_id = None

    def close_lane(self) -> None:
        """Run the handles the lane was given, end its thread, free its communicator."""
        if self.lane is not None:
            self.lane.close()
        self.lane = None

    def close(self) -> None:
        """``hvd.shutdown()``: the sets freed, the lane closed; the state is not used again."""
        if self.lane is not None:
            self.free_sets()
        self.close_lane()
        atexit.unregister(self.close_lane)

    def drop_world(self, why: str) -> None:
        """The parts of the old world: the registered sets (their communicators are abandoned, never freed:
        after a shrink they were revoked), the lane (dropped: its pending jobs end with an error) and
        ``join()``'s count on its communicator. The pending handles stay."""
        for entry in self.sets.values():
            entry.ps.process_set_id = None
        self.sets.clear()
        if self.lane is not None:
            self.lane.drop(why)
        self.lane = None
        self.absorbed = 0


_state: FacadeState | None = None  # the one reference to the façade's state: made by init(), gone at shutdown()


def current() -> FacadeState | None:
    """The façade's state, or None before ``init()`` and after ``shutdown()``."""
    return _state


def started() -> FacadeState:
    """The state, with its lane; ValueError where ``init()`` was not called. The asynchronous calls,
    ``join()`` and process sets need the lane, which ``init()`` makes (collectively: it cannot be made by
    the first such call, which other ranks may not be making)."""
    if _state is None or not _state.started:
        raise ValueError(f"rank {world.rank()}: adasum.horovod has not been initialized; call hvd.init() first "
                         "(on every rank)")
    return _state


def install() -> FacadeState:
    """The state, made where there is none (``init()``)."""
    global _state
    if _state is None:
        _state = FacadeState()
    return _state


def uninstall() -> None:
    """``shutdown()``: close the state and forget it."""
    global _state
    state, _state = _state, None
    if state is not None:
        state.close()


def wire(name: str) -> Wire:
    """The wire ``name`` of this thread: the state's where ``init()`` made one, else a new one."""
    return Wire(name) if _state is None else _state.wire(name)


def _rejoin() -> None:
    """After the world changed (collective over the new world): the state's old world dropped and its lane
    made again on the new one (nothing where ``init()`` was not called)."""
    if _state is not None:
        _state.drop_world("the world changed")
        _state.start()


when_world_changes(_rejoin)
