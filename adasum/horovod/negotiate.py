"""How the ranks of a process set agree on each call of :mod:`adasum.horovod` before any data moves.

Every call of the façade (a collective, ``barrier()``, ``join()``, adding a process set) starts with one
exchange on the set's communicator: each rank's :class:`RankCall` (its kind, what must be the same on every
rank, its own part, a problem found locally), gathered on every rank through
:func:`adasum.runtime.exchange.allgather` (so it is agreed and stall-watched like any call of the
library; all of the façade's calls are one kind of exchange there, :data:`WHAT`). Every rank then reads the
same list with :func:`verdict`, and so takes the same decision: go on, raise (the same error on every rank
that is not in ``join()``), or end a ``join()``.

A rank in ``join()`` answers the other ranks' calls (:func:`serve_joined`): with zeros where the call is an
allreduce (Sum, Average or Adasum: :attr:`RankCall.joinable`), as Horovod does; for any other call the ranks
that made it raise :class:`HorovodInternalError` and the joined rank goes on waiting.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from mpi4py import MPI

from ..runtime.agreement import AdasumMismatchError
from ..runtime import exchange, world
from .basics import HorovodInternalError

__all__ = ["RankCall", "Collective", "WHAT", "negotiate", "verdict", "execute", "run", "serve_joined", "RUN", "RAISE", "DONE"]

WHAT = "a call of adasum.horovod"
RUN, RAISE, DONE = "run", "raise", "done"


class RankCall(NamedTuple):
    """One rank's side of a call: ``agree`` (``(name, value)`` pairs) must be the same on every rank making
    the call; ``local`` is this rank's own part (its rows, its splits, an object); ``error`` a problem found
    on this rank (``(exception type, text)``); ``joinable``: a rank in ``join()`` answers it with zeros."""

    kind: str
    agree: tuple = ()
    local: Any = None
    error: tuple | None = None
    joinable: bool = False


def negotiate(comm: MPI.Intracomm, call: RankCall) -> list[RankCall]:
    """Every rank's :class:`RankCall`, in the order of ``comm``'s ranks (collective over ``comm``)."""
    return exchange.allgather(comm, call, what=WHAT, label=f"adasum.horovod.{call.kind}")


def _build(kind: type, text: str) -> Exception:
    try:
        return kind(text)
    except Exception:  # an exception type that takes other arguments
        return RuntimeError(f"{kind.__name__}: {text}")


def _show(agree: tuple) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in agree) or "nothing"


def verdict(everyone: list[RankCall], ranks: list[int], me: int) -> tuple[str, Exception | None]:
    """What every rank does after the negotiation (the same list gives the same answer on every rank):
    (:data:`DONE`, None) where every rank is in ``join()``, (:data:`RAISE`, the error) where the calls
    cannot go on, else (:data:`RUN`, None). ``ranks``: the world ranks of the set; ``me``: this rank's."""
    here = f"(raised on rank {me}) "
    active = [(ranks[i], c) for i, c in enumerate(everyone) if c.kind != "join"]
    if not active:
        return DONE, None
    joined = [ranks[i] for i, c in enumerate(everyone) if c.kind == "join"]
    failed = [(ranks[i], c.error) for i, c in enumerate(everyone) if c.error is not None]
    if failed:
        text = "; ".join(msg if msg.startswith(f"rank {r}:") else f"rank {r}: {msg}" for r, (_, msg) in failed)
        return RAISE, _build(failed[0][1][0], here + f"{active[0][1].kind}: " + text)
    r0, first = active[0]
    if any(c.kind != first.kind for _, c in active):
        return RAISE, AdasumMismatchError(here + "the ranks are in different calls: " + ", ".join(
            f"rank {r} is in adasum.horovod.{c.kind}" for r, c in active))
    differ = [(r, c) for r, c in active if c.agree != first.agree]
    if differ:
        return RAISE, AdasumMismatchError(
            here + f"the ranks' {first.kind} calls differ: rank {r0} passes {_show(first.agree)}; "
            + "; ".join(f"rank {r} passes {_show(c.agree)}" for r, c in differ))
    if joined and not first.joinable:
        return RAISE, HorovodInternalError(
            here + f"{first.kind} while rank(s) {joined} have called join(): a rank in join() answers only "
            "allreduce and grouped_allreduce with op Sum, Average or Adasum (with zeros); make every rank call "
            f"{first.kind} before join()")
    return RUN, None


def execute(comm: MPI.Intracomm, ranks: list[int], me: int, call: RankCall,
            run: Callable[[list[RankCall]], Any]) -> Any:
    """Negotiate ``call`` on ``comm``; raise where :func:`verdict` says so, else return ``run(everyone)``."""
    everyone = negotiate(comm, call)
    _, error = verdict(everyone, ranks, me)
    if error is not None:
        raise error
    return run(everyone)


class Collective(NamedTuple):
    """A collective of the façade ready to negotiate: its process set (a :class:`~.process_sets.ProcessSet`),
    this rank's :class:`RankCall`, and what runs once every rank agreed (``run(everyone, comm)``). Made by
    :mod:`.plans`; run by :func:`run`."""

    ps: Any
    call: RankCall
    run: Callable[[list[RankCall], MPI.Intracomm], Any]


def run(plan: Collective, stream: bool = False) -> Any:
    """Negotiate ``plan`` on its set's communicator (``stream``: the handles'), then run it."""
    comm = plan.ps.comm(stream)
    return execute(comm, plan.ps.ranks, world.rank(), plan.call, lambda everyone: plan.run(everyone, comm))


def serve_joined(comm: MPI.Intracomm, ranks: list[int], me: int,
                 zeros: Callable[[RankCall, MPI.Intracomm, float], None],
                 abandoned: Callable[[], str | None] = lambda: None) -> tuple[int, list[RankCall]]:
    """This rank's side of ``join()`` on ``comm``: answer the other ranks' calls until every rank has
    joined. ``zeros(call, comm, fill)`` takes part in a joinable ``call`` with tensors of ``fill``. Returns
    the number of calls answered and the last negotiation's calls.

    ``abandoned()`` says why this rank's ``join()`` failed elsewhere (its other communicator), or None: then
    the call already negotiated is answered with NaN rather than zeros, and the next one raises that
    reason on every other rank (a rank in ``join()`` too), which ends this loop."""
    served = 0
    while True:
        reason = abandoned()
        error = None if reason is None else (HorovodInternalError, f"rank {me}: {reason}")
        everyone = negotiate(comm, RankCall("join", local=served, error=error))
        action, failure = verdict(everyone, ranks, me)
        if action == DONE or error is not None:
            return served, everyone
        if action == RAISE and any(c.kind == "join" and c.error is not None for c in everyone):
            raise failure
        if action == RUN:
            zeros(next(c for c in everyone if c.kind != "join"), comm, 0.0 if abandoned() is None else float("nan"))
        served += 1
