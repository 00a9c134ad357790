"""``run``: the training function called again after every change of the world (the package docstring)."""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable

from mpi4py import MPI

from ...runtime import exchange, newcomer
from ...runtime.membership import lost_ranks, note_whereabouts, shrink, ulfm_problem, world
from .causes import AnotherRankRaised, HostsUpdatedInterrupt, _cause, _Fault, _leave_now, _summary
from .grow import check_settings, join, regrow
from .sharded import shards_lost
from .snapshot import State

__all__ = ["run", "tell_once", "inside_run"]

_log = logging.getLogger("adasum")
_told: list[bool] = [False]
_inside: list[int] = [0]  # calls of training functions decorated by run in progress in this process
_ON_ERROR = ("end", "leave")


def tell_once() -> str | None:
    """Where the MPI has no ULFM: say so once (a warning naming what to install and how to launch) and
    return why; None where it has."""
    problem = ulfm_problem()
    if problem is not None and not _told[0]:
        _told[0] = True
        _log.warning("adasum: %s; until then a rank that dies ends the job", problem)
    return problem


def inside_run() -> bool:
    """Whether a training function decorated by :func:`run` is running in this process."""
    return _inside[0] > 0


def _recover(state: State, fault: _Fault) -> BaseException | None:
    """Collective over the ranks still alive, each having met the fault: shrink the world, hear from every
    rank whether its training function raised, and either end the job (the exception to raise on this
    rank) or roll back and go on (None)."""
    before, group = world().Get_size(), world().Get_group()
    shrink()
    gone = lost_ranks(group, world())
    group.Free()
    shrank = world().Get_size() < fault.size  # over every attempt of this recovery
    lost = shards_lost(state.model, fault.size) if shrank else None
    if lost is not None:  # every survivor alike: a sharded model does not go on
        fault.disarm()
        return lost
    certain = fault.own is not None
    guess = fault.maybe is not None and not shrank  # an MPI error that no death explains
    mine = _summary(fault.own if certain else fault.maybe) if certain or guess else None
    votes = exchange.allgather(world(), (MPI.COMM_WORLD.Get_rank(), mine, certain),
                               what="the elastic ranks' errors")
    raised = [(r, text) for r, text, sure in votes if text is not None and sure]
    raised = raised or [(r, text) for r, text, _ in votes if text is not None]
    if raised:
        fault.disarm()
        if mine is not None and (certain or not any(sure for _, _, sure in votes)):
            return fault.own if certain else fault.maybe
        ranks, errors = [r for r, _ in raised], [t for _, t in raised]
        return AnotherRankRaised(
            f"rank {MPI.COMM_WORLD.Get_rank()}: the elastic training function raised on rank"
            f"{'s' * (len(ranks) != 1)} {', '.join(map(str, ranks))} (of MPI.COMM_WORLD): "
            + "; ".join(errors) + "; the job ends (that rank's output has the traceback)", ranks, errors)
    state._roll_back(before, fault.detected, gone)
    return None


class _Attempt:
    """What the next call of the training function follows, on this rank: a fault to recover from, the
    world to grow back, this newcomer's joining, or nothing (the first call)."""

    def __init__(self, state: State, problem: str | None):
        self.fault: _Fault | None = None
        self.detected: float | None = None  # of the last fault recovered from (time.monotonic())
        self.grow_from: float | None = None  # the world is to grow back (time.monotonic() of the interrupt)
        self.joining = problem is None and newcomer.pending() is not None
        self.sync = True
        if state.launch_size is None and not self.joining:
            state.launch_size = world().Get_size()  # a newcomer receives it in the sync

    def prepare(self, state: State) -> BaseException | None:
        """The steps before the next call: the recovery, the growth or the join. The exception that ends
        the job on this rank, or None."""
        self.sync = True
        if self.fault is not None:
            self.fault.arm()
            ending = _recover(state, self.fault)
            if ending is None:
                self.detected, self.fault = self.fault.detected, None
            return ending
        if self.grow_from is not None:
            grew = regrow(state)
            self.sync = grew  # a failed attempt changed nothing: no need to sync again
            self.grow_from = self.grow_from if grew else None
        elif self.joining:
            self.joining = False  # once: a fault after it is recovered from as any other
            join(state)
            self.grow_from = time.monotonic()
        return None

    def enter(self, state: State, problem: str | None) -> None:
        """Collective: the state of rank 0 everywhere (where needed), the timings noted."""
        if problem is None:  # where a stall timeout may have to kill a silent rank
            note_whereabouts(lambda obj: exchange.allgather(world(), obj, what="the ranks' hosts"))
            check_settings()
        if self.sync:
            state.sync()
        newcomer.disarm()
        if self.detected is not None:
            state.last_recovery_seconds = time.monotonic() - self.detected
            state.last_resumed_at = time.time()
            self.detected = None
        if self.grow_from is not None:
            state.last_grow_seconds = time.monotonic() - self.grow_from
            state.last_grown_at = time.time()
            self.grow_from = None


def run(func: Callable[..., Any] | None = None, *, on_error: str = "end") -> Callable[..., Any]:
    """Decorate a training function ``func(state, *args, **kwargs)`` so that a rank's death makes the
    survivors go on, and where ``elastic_replace`` is on the world grows back (the package docstring):
    each call starts with ``state.sync()``; a failure is followed by the shrink, ``state.reset``'s steps
    and the next call; a :class:`HostsUpdatedInterrupt` (``state.commit()`` when the world is to grow back)
    by the growth and the next call, on the survivors and on the newcomers.

    An error of the training function itself on one rank (``on_error="end"``, the default) ends the job:
    the communicators revoked, so that the other ranks leave the call they are in at once; every rank
    hears of it; it leaves ``run`` on the rank that raised it, and :class:`AnotherRankRaised` on the
    others. ``on_error="leave"`` is Horovod's elastic behaviour instead: that rank shows its traceback and
    dies (SIGKILL), the others go on without it as after any death. ``@run`` and
    ``@run(on_error=...)`` both decorate. Without ULFM errors propagate as they would without ``run``."""
    if on_error not in _ON_ERROR:
        raise ValueError(f"on_error must be one of {_ON_ERROR}, got {on_error!r}")
    if func is None:
        return functools.partial(run, on_error=on_error)

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        problem = tell_once()
        attempt = _Attempt(state, problem)
        state._in_run = True
        _inside[0] += 1
        try:
            while True:
                try:
                    ending = attempt.prepare(state)
                    if ending is None:
                        attempt.enter(state, problem)
                        return func(state, *args, **kwargs)
                except HostsUpdatedInterrupt:  # raised by the training function only (state.commit())
                    attempt.grow_from = time.monotonic()
                    continue
                except BaseException as exc:  # noqa: BLE001 - every rank must hear of it, or the others wait
                    if problem is not None:
                        raise
                    if on_error == "leave" and attempt.fault is None and _cause(exc) == "raised":
                        _leave_now(exc)
                    _fault(attempt, state, exc)
                    continue
                raise ending
        finally:
            state._in_run = False
            _inside[0] -= 1

    return wrapper


def _fault(attempt: _Attempt, state: State, exc: BaseException) -> None:
    """Note ``exc`` in the fault being recovered from (a new one where there is none)."""
    if attempt.fault is None:
        attempt.fault = _Fault()
        state.last_failure_seen_at = time.time()
    attempt.grow_from = None
    attempt.fault.met(exc)
