"""Small exchanges between the ranks that are not reductions of tensors: a vote, Python objects gathered
or broadcast, a byte buffer broadcast. The training layer (``adasum.torch``) makes every MPI call of its own
through these, so that each one is a numbered call on the library's duplicate of the communicator and waits
through the stall inspector (:mod:`adasum.runtime.stall`): a rank that never arrives makes the waiting ranks log,
or raise :class:`~adasum.runtime.stall.AdasumStallError`, naming it, as the collective does.

Each function is collective over ``comm`` and posts nonblocking MPI collectives, whose requests the stall
inspector waits for. The first of them is always the agreement's four integers (:mod:`adasum.runtime.agreement`),
carrying the exchange's kind (its ``what``), whether the rank failed before sending (an object that does
not pickle) and a vote (the largest message's size): two different kinds of call never match each other,
and a failure on one rank becomes the same error on every rank, the library's communicator staying usable.
Objects travel pickled, as two collectives (that agreement, then the bytes, each rank's padded to the
largest). What they send
counts as ``scalar_bytes`` in :func:`adasum.count_traffic`.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
from mpi4py import MPI

from . import stall
from .agreement import agree_exchange
from .context import Call, check_comm, check_root, context_for

__all__ = ["any_true", "max_of", "allgather", "bcast", "gather", "scatter", "bcast_buffer", "failures",
           "failures_in", "any_true_in", "allgather_in", "raise_everywhere", "raise_found", "call_on", "wait"]


def any_true(comm: MPI.Intracomm | None, flag: bool, what: str = "vote") -> bool:
    """Whether ``flag`` is true on any rank of ``comm``."""
    with call_on(comm, what) as call:
        return any_true_in(call, flag, what)


def any_true_in(call: Call, flag: bool, what: str) -> bool:
    """:func:`any_true` inside the call ``call`` (as :func:`failures_in`): the flag is
    the agreement's vote."""
    return bool(agree_exchange(call, what, None, 1 if flag else 0))


def max_of(comm: MPI.Intracomm | None, values: np.ndarray, what: str = "maximum") -> np.ndarray:
    """The element-wise maximum over the ranks of ``values`` (a float64 array of the same length on every
    rank); NaN wins over every number."""
    with call_on(comm, what) as call:
        mine = np.ascontiguousarray(values, dtype=np.float64)
        agree_exchange(call, what, None, extra=(("values", mine.size),))
        # NaN does not order under MPI.MAX: it travels as +Inf in a second slot per value.
        nan = np.isnan(mine)
        send = np.concatenate([np.where(nan, -np.inf, mine), nan.astype(np.float64)])
        out = np.empty_like(send)
        wait(call, call.lcomm.Iallreduce(send, out, op=MPI.MAX), what, send.nbytes)
        n = mine.size
        return np.where(out[n:] > 0, np.nan, out[:n])


def allgather(comm: MPI.Intracomm | None, obj: Any, what: str = "allgather", label: str | None = None) -> list:
    """Every rank's ``obj``, in rank order, on every rank. ``label`` (default ``what``) names this call where
    the ranks turn out to be in different calls; the kind of call that must match is ``what``."""
    with call_on(comm, what) as call:
        return allgather_in(call, obj, what, label)


def allgather_in(call: Call, obj: Any, what: str, label: str | None = None) -> list:
    """:func:`allgather` inside the call ``call`` (as :func:`failures_in`)."""
    data, error = _pickled(obj, call.ctx.rank, what)
    width = agree_exchange(call, what, error, _SIZE + data.size, label=label)
    out = np.empty(width * call.ctx.size, dtype=np.uint8)
    wait(call, call.lcomm.Iallgather([_padded(data, width), MPI.BYTE], [out, MPI.BYTE]), what, width)
    return [_unpadded(out[r * width:(r + 1) * width]) for r in range(call.ctx.size)]


def bcast(comm: MPI.Intracomm | None, obj: Any, root: int = 0, what: str = "broadcast") -> Any:
    """``root``'s ``obj`` on every rank (what the other ranks pass is ignored)."""
    check_root(check_comm(comm), root)
    with call_on(comm, what) as call:
        data, error = _pickled(obj, call.ctx.rank, what) if call.ctx.rank == root else (None, None)
        size = agree_exchange(call, what, error, 0 if data is None else data.size, extra=(("root", root),))
        if data is None:
            data = np.empty(size, dtype=np.uint8)
        wait(call, call.lcomm.Ibcast([data, MPI.BYTE], root=root), what, data.size if call.ctx.rank == root else 0)
        return obj if call.ctx.rank == root else pickle.loads(data.tobytes())


def gather(comm: MPI.Intracomm | None, obj: Any, root: int = 0, what: str = "gather") -> list | None:
    """Every rank's ``obj``, in rank order, on ``root``; None on the other ranks."""
    check_root(check_comm(comm), root)
    with call_on(comm, what) as call:
        data, error = _pickled(obj, call.ctx.rank, what)
        width = agree_exchange(call, what, error, _SIZE + data.size, extra=(("root", root),))
        send = _padded(data, width)
        if call.ctx.rank != root:
            wait(call, call.lcomm.Igather([send, MPI.BYTE], None, root=root), what, width)
            return None
        out = np.empty(width * call.ctx.size, dtype=np.uint8)
        wait(call, call.lcomm.Igather([send, MPI.BYTE], [out, MPI.BYTE], root=root), what, width)
        return [_unpadded(out[r * width:(r + 1) * width]) for r in range(call.ctx.size)]


def scatter(comm: MPI.Intracomm | None, objs: list | None, root: int = 0, what: str = "scatter") -> Any:
    """Rank ``r`` gets ``objs[r]`` of ``root`` (``objs``: one object per rank on ``root``, ignored elsewhere)."""
    check_root(check_comm(comm), root)
    with call_on(comm, what) as call:
        parts, error = [], None
        if call.ctx.rank == root:
            if objs is None or len(objs) != call.ctx.size:
                error = ValueError(f"rank {root}: scatter needs one object per rank ({call.ctx.size}), got "
                                   f"{None if objs is None else len(objs)}")
            else:
                for o in objs:
                    data, error = _pickled(o, call.ctx.rank, what)
                    if error is not None:
                        break
                    parts.append(data)
        width = agree_exchange(call, what, error, _SIZE + max((p.size for p in parts), default=0),
                               extra=(("root", root),))
        out = np.empty(width, dtype=np.uint8)
        if call.ctx.rank == root:
            data = np.concatenate([_padded(p, width) for p in parts])
            wait(call, call.lcomm.Iscatter([data, MPI.BYTE], [out, MPI.BYTE], root=root), what, data.size)
        else:
            wait(call, call.lcomm.Iscatter(None, [out, MPI.BYTE], root=root), what, 0)
        return _unpadded(out)


def bcast_buffer(comm: MPI.Intracomm | None, buf: np.ndarray, root: int = 0, what: str = "broadcast") -> None:
    """``root``'s bytes of ``buf`` (a contiguous numpy array, the same size on every rank) into every
    rank's ``buf``."""
    check_root(check_comm(comm), root)
    with call_on(comm, what) as call:
        agree_exchange(call, what, None, extra=(("root", root), ("bytes", buf.nbytes)))
        if buf.size:
            wait(call, call.lcomm.Ibcast([buf, MPI.BYTE], root=root), what, buf.nbytes if call.ctx.rank == root else 0)


def failures(comm: MPI.Intracomm | None, problem: str | None, what: str = "an error vote") -> str | None:
    """Collective: every rank's ``problem`` ("rank r: …; …", in rank order), or None where no rank has one.
    One small vote when none has; the problems travel only when one has."""
    comm = check_comm(comm)
    if comm.Get_size() == 1:
        return _joined([problem])
    with call_on(comm, what) as call:
        return failures_in(call, problem, what)


def failures_in(call: Call, problem: str | None, what: str) -> str | None:
    """:func:`failures` inside the call ``call`` on its communicator (the library's own
    collective steps, such as finding the node layout)."""
    if call.ctx.size == 1:
        return _joined([problem])
    if not any_true_in(call, problem is not None, what):
        return None
    return _joined(allgather_in(call, problem, what))


def _joined(problems: list) -> str | None:
    found = [p if p.startswith(f"rank {r}:") else f"rank {r}: {p}" for r, p in enumerate(problems) if p]
    return "; ".join(found) or None


def raise_everywhere(comm: MPI.Intracomm | None, problem: str | None, kind: type = ValueError,
                     what: str = "an error vote") -> None:
    """Collective: where any rank has a ``problem``, raise ``kind`` on every rank, naming every rank's."""
    comm = check_comm(comm)
    raise_found(comm.Get_rank(), failures(comm, problem, what), kind)


def raise_found(rank: int, text: str | None, kind: type = ValueError) -> None:
    """Raise ``kind`` with ``text`` (what went wrong, on which ranks) on this ``rank``, unless ``text`` is
    None: the one form of an error that every rank raises, each saying where it was raised."""
    if text is not None:
        raise kind(f"(raised on rank {rank}) {text}")


def call_on(comm: MPI.Intracomm | None, what: str):
    """``with call_on(comm, what) as call:`` a numbered call ``what`` on ``comm``'s context
    (:meth:`~adasum.runtime.context.Context.call`), for other small collectives of the library that wait as
    these do."""
    return context_for(comm).call(what)


def wait(call: Call, req: MPI.Request, what: str, nbytes: int, field: str = "scalar_bytes") -> None:
    """Wait for ``req`` through the stall inspector; ``nbytes`` this rank sent count in ``field``."""
    call.record(field, nbytes)
    stall.wait(call, req, "exchange", nbytes, label=what)


_SIZE = 8  # each padded message starts with its length, as an int64


def _pickled(obj: Any, rank: int, what: str) -> tuple[np.ndarray, Exception | None]:
    """``obj``'s pickle as bytes, or (no bytes, the error naming ``rank`` and the exchange) where it does
    not pickle: the exchange's agreement then raises it on every rank."""
    try:
        return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8), None
    except Exception as exc:
        text = f"rank {rank}: {what}: the object does not pickle ({type(exc).__name__}: {exc})"
        try:
            error = type(exc)(text)
        except Exception:  # an exception type that takes other arguments
            error = TypeError(text)
        return np.empty(0, dtype=np.uint8), error


def _padded(data: np.ndarray, width: int) -> np.ndarray:
    """``data`` after its length, in ``width`` bytes (every rank's message of an exchange has one size)."""
    out = np.zeros(width, dtype=np.uint8)
    out[:_SIZE] = np.frombuffer(np.int64(data.size).tobytes(), dtype=np.uint8)
    out[_SIZE:_SIZE + data.size] = data
    return out


def _unpadded(row: np.ndarray) -> Any:
    n = int(row[:_SIZE].view(np.int64)[0])
    return pickle.loads(row[_SIZE:_SIZE + n].tobytes())
