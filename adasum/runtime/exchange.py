"""Small exchanges between the ranks that are not reductions of tensors: a vote, Python objects gathered
or broadcast, a byte buffer broadcast. The training layer (``adasum.torch``) makes every MPI call of its own
through these, so that each one is a numbered call on the library's duplicate of the communicator and waits
through the stall inspector (:mod:`adasum.runtime.stall`): a rank that never arrives makes the waiting ranks log,
or raise :class:`~adasum.runtime.stall.AdasumStallError`, naming it, as the collective does.

Each function is collective over ``comm`` and posts nonblocking MPI collectives, whose requests the stall
inspector waits for. Objects travel pickled, as two collectives (the sizes, then the bytes). What they send
counts as ``scalar_bytes`` in :func:`adasum.count_traffic`.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
from mpi4py import MPI

from . import stall
from .context import Context, check_comm, check_root, context_for

__all__ = ["any_true", "max_of", "allgather", "bcast", "gather", "scatter", "bcast_buffer", "failures",
           "failures_in", "any_true_in", "allgather_in", "raise_everywhere", "raise_found", "enter", "wait"]


def any_true(comm: MPI.Intracomm | None, flag: bool, what: str = "vote") -> bool:
    """Whether ``flag`` is true on any rank of ``comm``."""
    ctx = enter(comm, what)
    try:
        return any_true_in(ctx, flag, what)
    finally:
        ctx.leave()


def any_true_in(ctx: Context, flag: bool, what: str) -> bool:
    """:func:`any_true` inside a call already in flight on ``ctx`` (as :func:`failures_in`)."""
    mine = np.array([1 if flag else 0], dtype=np.int64)
    out = np.zeros(1, dtype=np.int64)
    wait(ctx, ctx.lcomm.Iallreduce(mine, out, op=MPI.MAX), what, 8)
    return bool(out[0])


def max_of(comm: MPI.Intracomm | None, values: np.ndarray, what: str = "maximum") -> np.ndarray:
    """The element-wise maximum over the ranks of ``values`` (a float64 array of the same length on every
    rank); NaN wins over every number."""
    ctx = enter(comm, what)
    try:
        mine = np.ascontiguousarray(values, dtype=np.float64)
        # NaN does not order under MPI.MAX: it travels as +Inf in a second slot per value.
        nan = np.isnan(mine)
        send = np.concatenate([np.where(nan, -np.inf, mine), nan.astype(np.float64)])
        out = np.empty_like(send)
        wait(ctx, ctx.lcomm.Iallreduce(send, out, op=MPI.MAX), what, send.nbytes)
        n = mine.size
        return np.where(out[n:] > 0, np.nan, out[:n])
    finally:
        ctx.leave()


def allgather(comm: MPI.Intracomm | None, obj: Any, what: str = "allgather") -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    ctx = enter(comm, what)
    try:
        return allgather_in(ctx, obj, what)
    finally:
        ctx.leave()


def allgather_in(ctx: Context, obj: Any, what: str) -> list:
    """:func:`allgather` inside a call already in flight on ``ctx`` (as :func:`failures_in`)."""
    data = _dumps(obj)
    sizes = np.empty(ctx.size, dtype=np.int64)
    wait(ctx, ctx.lcomm.Iallgather(np.array([data.size], dtype=np.int64), sizes), what, 8)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    wait(ctx, ctx.lcomm.Iallgatherv(data, [out, (sizes, offsets), MPI.BYTE]), what, data.size)
    return [pickle.loads(out[o:o + s].tobytes()) for o, s in zip(offsets, sizes)]


def bcast(comm: MPI.Intracomm | None, obj: Any, root: int = 0, what: str = "broadcast") -> Any:
    """``root``'s ``obj`` on every rank (what the other ranks pass is ignored)."""
    check_root(check_comm(comm), root)
    ctx = enter(comm, what)
    try:
        data = _dumps(obj) if ctx.rank == root else None
        size = np.array([0 if data is None else data.size], dtype=np.int64)
        wait(ctx, ctx.lcomm.Ibcast(size, root=root), what, 8)
        if data is None:
            data = np.empty(int(size[0]), dtype=np.uint8)
        wait(ctx, ctx.lcomm.Ibcast([data, MPI.BYTE], root=root), what, data.size if ctx.rank == root else 0)
        return obj if ctx.rank == root else pickle.loads(data.tobytes())
    finally:
        ctx.leave()


def gather(comm: MPI.Intracomm | None, obj: Any, root: int = 0, what: str = "gather") -> list | None:
    """Every rank's ``obj``, in rank order, on ``root``; None on the other ranks."""
    check_root(check_comm(comm), root)
    ctx = enter(comm, what)
    try:
        data = _dumps(obj)
        sizes = np.zeros(ctx.size, dtype=np.int64)
        wait(ctx, ctx.lcomm.Igather(np.array([data.size], dtype=np.int64), sizes, root=root), what, 8)
        if ctx.rank != root:
            wait(ctx, ctx.lcomm.Igatherv(data, None, root=root), what, data.size)
            return None
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        wait(ctx, ctx.lcomm.Igatherv(data, [out, (sizes, offsets), MPI.BYTE], root=root), what, data.size)
        return [pickle.loads(out[o:o + s].tobytes()) for o, s in zip(offsets, sizes)]
    finally:
        ctx.leave()


def scatter(comm: MPI.Intracomm | None, objs: list | None, root: int = 0, what: str = "scatter") -> Any:
    """Rank ``r`` gets ``objs[r]`` of ``root`` (``objs``: one object per rank on ``root``, ignored elsewhere)."""
    check_root(check_comm(comm), root)
    ctx = enter(comm, what)
    try:
        if ctx.rank == root:
            if objs is None or len(objs) != ctx.size:
                raise ValueError(f"rank {root}: scatter needs one object per rank ({ctx.size}), got "
                                 f"{None if objs is None else len(objs)}")
            parts = [_dumps(o) for o in objs]
            sizes = np.array([p.size for p in parts], dtype=np.int64)
        else:
            parts, sizes = [], np.zeros(ctx.size, dtype=np.int64)
        mine = np.zeros(1, dtype=np.int64)
        wait(ctx, ctx.lcomm.Iscatter(sizes, mine, root=root), what, sizes.nbytes if ctx.rank == root else 0)
        out = np.empty(int(mine[0]), dtype=np.uint8)
        if ctx.rank == root:
            data = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint8)
            offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            req = ctx.lcomm.Iscatterv([data, (sizes, offsets), MPI.BYTE], out, root=root)
            wait(ctx, req, what, data.size)
        else:
            wait(ctx, ctx.lcomm.Iscatterv(None, out, root=root), what, 0)
        return pickle.loads(out.tobytes())
    finally:
        ctx.leave()


def bcast_buffer(comm: MPI.Intracomm | None, buf: np.ndarray, root: int = 0, what: str = "broadcast") -> None:
    """``root``'s bytes of ``buf`` (a contiguous numpy array, the same size on every rank) into every
    rank's ``buf``."""
    check_root(check_comm(comm), root)
    ctx = enter(comm, what)
    try:
        if buf.size:
            wait(ctx, ctx.lcomm.Ibcast([buf, MPI.BYTE], root=root), what, buf.nbytes if ctx.rank == root else 0)
    finally:
        ctx.leave()


def failures(comm: MPI.Intracomm | None, problem: str | None, what: str = "an error vote") -> str | None:
    """Collective: every rank's ``problem`` ("rank r: …; …", in rank order), or None where no rank has one.
    One small vote when none has; the problems travel only when one has."""
    comm = check_comm(comm)
    if comm.Get_size() == 1:
        return _joined([problem])
    ctx = enter(comm, what)
    try:
        return failures_in(ctx, problem, what)
    finally:
        ctx.leave()


def failures_in(ctx: Context, problem: str | None, what: str) -> str | None:
    """:func:`failures` on ``ctx``'s communicator inside a call already in flight there (the library's own
    collective steps, such as finding the node layout)."""
    if ctx.size == 1:
        return _joined([problem])
    if not any_true_in(ctx, problem is not None, what):
        return None
    return _joined(allgather_in(ctx, problem, what))


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


def enter(comm: MPI.Intracomm | None, what: str) -> Context:
    """Start a numbered call ``what`` on ``comm``'s context (end it with ``ctx.leave()`` in a ``finally``):
    for other small collectives of the library that wait as these do."""
    ctx = context_for(comm)
    ctx.lcomm  # noqa: B018 - made (collectively, watched) before the call is numbered
    if ctx.enter(what) % 64 == 0:
        stall.drain(ctx)
    return ctx


def wait(ctx: Context, req: MPI.Request, what: str, nbytes: int, field: str = "scalar_bytes") -> None:
    """Wait for ``req`` through the stall inspector; ``nbytes`` this rank sent count in ``field``."""
    ctx.record(field, nbytes)
    stall.wait(ctx, req, "exchange", nbytes, label=what)


def _dumps(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
