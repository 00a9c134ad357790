"""The stall inspector: a rank that never arrives becomes a message that names it.

Every call starts with the agreement, one small allreduce on the library's communicator (see
:mod:`adasum.runtime.agreement`). It is posted nonblocking and waited for like a blocking allreduce (without the GIL,
by the compiled kernels where they are bound) for a short patience. A rank still waiting after that tells
every other rank of the communicator, with one small message, that it is in call #N (its op, number of
tensors and bytes), and goes on waiting while it collects the others' messages. So the ranks that have
arrived know of each other, and the ranks nobody heard from are the ones that have not entered call #N:

- after ``stall_warning`` seconds (setting, default 60; ``ADASUM_STALL_WARNING``) the lowest waiting rank
  logs once, on the ``adasum`` logger, which ranks have not entered the call and what the waiting ranks
  passed;
- after ``stall_timeout`` seconds (default off; ``ADASUM_STALL_TIMEOUT``) every waiting rank raises
  :class:`AdasumStallError` with that text. Under ``python -m mpi4py`` this ends the job. The library's
  communicator is left with the unfinished agreement, so later calls on that communicator raise the same
  error at once: a stall timeout is the end of that communicator for the library.

Messages from ranks that waited in an earlier call are received and dropped when they are next looked for.

A communicator whose owner may give it up while a thread waits there (the overlap engine's, see
:meth:`adasum.runtime.lane.Lane.drop`; ``Context.may_give_up``) is waited on with a patience of at
most ``GIVE_UP_EVERY`` seconds, with or without the inspector: once its context is marked ``broken``, the
wait raises :class:`AdasumStallError` within that time, and the thread leaves the MPI library.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
from mpi4py import MPI


from ..rule.dtypes import itemsize, op_code, op_name
from .errors import AdasumCollectiveError, AdasumStallError
from .faults import failed, is_failure
from .transport import TAG
from .waiting import wait_all

__all__ = ["AdasumCollectiveError", "AdasumStallError", "drain", "forget", "patience", "wait"]

_log = logging.getLogger("adasum")

# The tag of the "I am waiting in call #N" messages on the library's communicator.
STALL_TAG = TAG + 2
# A rank tells the others that it is waiting once it has waited this long (or less, with shorter settings).
ANNOUNCE_AFTER = 1.0
_FIELDS = 5  # call number, op, tensors, bytes, rank
# On a communicator that may be given up, a wait looks this often whether it was.
GIVE_UP_EVERY = 0.1


def patience(s, ctx=None) -> float:
    """Seconds a call waits for the agreement as a blocking allreduce would, before the inspector looks:
    0 (for ever) when neither a warning nor a timeout is set. On ``ctx`` that may be given up, at most
    ``GIVE_UP_EVERY``."""
    if s.stall_warning is None and s.stall_timeout is None:
        first = 0.0
    else:
        first = min(t for t in (ANNOUNCE_AFTER, s.stall_warning, s.stall_timeout) if t is not None)
    if ctx is not None and getattr(ctx, "may_give_up", False):
        return min(first, GIVE_UP_EVERY) if first else GIVE_UP_EVERY
    return first


def _wait_or_give_up(call, reqs: list, until: float | None) -> bool:
    """:func:`adasum.runtime.waiting.wait_all` of ``reqs`` until ``until`` (None: their end); on a context
    that may be given up, raising once it was."""
    ctx, native = call.ctx, call.settings.native_mpi
    if not getattr(ctx, "may_give_up", False):
        return wait_all(reqs, call.waiting, until=until, native=native)
    while True:
        _check_given_up(ctx)
        step = time.monotonic() + GIVE_UP_EVERY
        if wait_all(reqs, call.waiting, until=step if until is None else min(step, until), native=native):
            return True
        if until is not None and time.monotonic() >= until:
            return False


def _check_given_up(ctx) -> None:
    if ctx.broken is not None and getattr(ctx, "may_give_up", False):
        raise AdasumStallError(f"rank {ctx.rank}: a call on {ctx.name} was given up: {ctx.broken}")


def _describe(op: str | None, descs) -> tuple[int, int, int]:
    if op is None:
        return -2, -1, -1
    if op == "exchange":
        return op_code(op), 0, int(descs)
    if descs is None:
        return -1, -1, -1
    nbytes = sum(math.prod(d.shape) * itemsize(d.dtype) for d in descs)
    return op_code(op), len(descs), nbytes


def _what(fields, label: str | None = None) -> str:
    op, n, nbytes = (int(v) for v in fields)
    name = op_name(op)
    if name == "exchange":
        return f"an exchange ({label + ', ' if label else ''}{nbytes} bytes)"
    if n < 0:
        return "making the library's duplicate of it" if op == -2 else "inputs it could not describe"
    return f"op '{name or '?'}', {n} tensor{'s' * (n != 1)}, {nbytes} bytes"


def _announce(ctx, comm: MPI.Intracomm, mine: np.ndarray) -> None:
    ctx.stall_sends = [r for r in ctx.stall_sends if not r.Test()]
    for other in range(ctx.size):
        if other != ctx.rank:
            ctx.stall_sends.append(comm.Isend([mine, MPI.INT64_T], other, STALL_TAG))


def _collect(comm: MPI.Intracomm, seq: int, heard: dict) -> None:
    """Receive every waiting message that has arrived on ``comm``; keep those of call ``seq``.

    Each message is received as the one its probe matched (a matched probe), and read only where it names
    a rank of ``comm``: a message left behind on a communicator that was freed meanwhile can meet a later
    communicator that MPI gave the same context, and must neither raise nor count."""
    size = comm.Get_size()
    buf = np.empty(_FIELDS, dtype=np.int64)
    while True:
        message = comm.Improbe(MPI.ANY_SOURCE, STALL_TAG)
        if message is None:
            return
        message.Recv([buf, MPI.INT64_T])
        if int(buf[0]) == seq and 0 <= int(buf[4]) < size:
            heard[int(buf[4])] = buf[1:4].copy()


def forget(comm: MPI.Intracomm) -> None:
    """Drop the inspector's messages waiting on ``comm``, before the library frees it: left there, they
    would stay in this rank's queue under the communicator's context, which MPI may give to the next
    communicator it makes. Where MPI cannot look any more (a rank of it died), nothing is dropped."""
    try:
        _collect(comm, -1, {})
    except MPI.Exception:
        pass


def drain(call) -> None:
    """Drop waiting messages of earlier calls (a rank that arrived late never looked for them)."""
    _collect(call.lcomm, -1, {})


def wait(call, req: MPI.Request | list, op: str | None, descs, waited: float = 0.0,
         via: MPI.Intracomm | None = None, label: str | None = None) -> None:
    """:func:`_wait`; a rank that died makes it raise :class:`adasum.runtime.faults.WorldChanged`."""
    try:
        _wait(call, req, op, descs, waited, via, label)
    except MPI.Exception as exc:
        if is_failure(exc):
            raise failed(exc, call.what) from exc
        raise


def _wait(call, req: MPI.Request | list, op: str | None, descs, waited: float = 0.0,
          via: MPI.Intracomm | None = None, label: str | None = None) -> None:
    """Wait for ``req`` (a request or a list of them), a collective of the call ``call`` (:class:`adasum.runtime.context.Call`; ``op`` and ``descs``: what
    this rank passed; ``op`` None: the duplicate of a first call; ``op`` "exchange": one of
    :mod:`adasum.runtime.exchange`'s calls, ``descs`` its bytes and ``label`` what it is for), ``waited`` seconds
    after it was posted,
    watching for ranks that do not arrive. The inspector's messages go over the library's communicator, or
    over ``via`` (the user's communicator, while the library's is being made)."""
    s = call.settings
    reqs = req if type(req) is list else [req]
    warn, timeout = s.stall_warning, s.stall_timeout
    if warn is None and timeout is None:
        _wait_or_give_up(call, reqs, None)
        return
    ctx = call.ctx
    comm = call.lcomm if via is None else via
    first = patience(s)
    start = time.monotonic() - waited
    if _wait_or_give_up(call, reqs, start + first):  # as any wait of the library (adasum.runtime.waiting)
        if via is not None:  # drop what an earlier stall left on the user's communicator
            _collect(via, -1, {})
        return
    seq = call.number
    mine = np.array([seq, *_describe(op, descs), ctx.rank], dtype=np.int64)
    heard: dict[int, np.ndarray] = {ctx.rank: mine[1:4]}
    _announce(ctx, comm, mine)
    reported, delay = False, 1e-4
    while not MPI.Request.Testall(reqs):
        _check_given_up(ctx)
        _collect(comm, seq, heard)
        elapsed = time.monotonic() - start
        if warn is not None and not reported and elapsed >= warn + first:
            reported = True
            if ctx.rank == min(heard):
                _log.warning("adasum: %s", _report(ctx, seq, heard, elapsed, label))
        if timeout is not None and elapsed >= timeout:
            text = _report(ctx, seq, heard, elapsed, label)
            ctx.broken = text
            raise AdasumStallError(text, silent=[r for r in range(ctx.size) if r not in heard], comm=comm)
        time.sleep(delay)
        delay = min(2 * delay, 0.01)
    if via is not None:
        _collect(via, -1, {})


def _report(ctx, seq: int, heard: dict, elapsed: float, label: str | None = None) -> str:
    missing = [r for r in range(ctx.size) if r not in heard]
    mine = heard[ctx.rank]
    others = [f"rank {r} with {_what(f)}" for r, f in sorted(heard.items())
              if r != ctx.rank and not np.array_equal(f, mine)]
    text = (f"rank {ctx.rank}: call #{seq} on {ctx.name} ({_what(mine, label)}) has waited {elapsed:.1f} s for "
            f"rank{'s' * (len(missing) != 1)} {', '.join(map(str, missing)) or '(none: all announced)'}, "
            f"which {'has' if len(missing) == 1 else 'have'} not entered it; "
            f"waiting in it: rank{'s' * (len(heard) != 1)} {', '.join(map(str, sorted(heard)))}")
    if others:
        text += "; of those, " + "; ".join(others)
    return text
