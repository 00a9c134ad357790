"""The decision at the close of a window, written once: every path that combines (the optimizer's boundary,
overlap, local steps with or without ``delay=1``, the DDP delta hook, ``flush()``, the end of Lightning's
``fit()``) asks :func:`agree` before anything changes, and finishes through :func:`settle`.

:func:`agree` is one small collective that carries, together, what each rank must know of the others:

- whether a rank failed (a local step or a hook raised, a wire job failed): then every rank raises;
- whether a rank's gradients overflowed under a loss scale (every rank then backs the scale off);
- the window's ledger: which combine this is, how many ``step()`` calls each rank made so far, how many
  local steps and micro-batches the window holds; a rank that skipped or added a ``step()`` is found here
  (at the latest at ``flush()``) and every rank raises naming the ranks and their counts;
- the parameters the window holds (count, shapes, dtypes): a rank whose parameters differ makes every rank
  raise naming the first differing parameter, before any byte of the combine is sent.

The caller restores what it changed (the window's start) before it raises, so an error leaves every rank
where the window began.
"""

from __future__ import annotations

import logging
import zlib

import torch
from mpi4py import MPI

from ...runtime.agreement import AdasumMismatchError, agree_exchange
from ...runtime import exchange
from ...runtime.context import check_comm

__all__ = ["Decision", "Layout", "Ledger", "agree", "companion_extra", "differences", "log_skip"]

_log = logging.getLogger("adasum")

_WHAT = "the window's agreement"


class Decision:
    """What :func:`agree` found: ``failed`` (every rank's errors, or None), ``overflowed`` (on any rank)."""

    __slots__ = ("failed", "overflowed")

    def __init__(self, failed: str | None, overflowed: bool):
        self.failed = failed
        self.overflowed = overflowed


class Ledger:
    """The counts every rank must agree on where a window closes: which combine it is, how many
    micro-batches the ranks recorded in the windows closed so far (this one included), how many local steps
    the window holds. Shared by an optimizer's parts (the boundary, the overlap's lane, local steps)."""

    def __init__(self, window):
        self.window = window    # the AccumulationWindow: micro-batches recorded and closed
        self.combines = 0       # combines done (windows closed with a combine, skipped ones included)
        self.local = None       # LocalSteps, where the optimizer takes local steps

    def at(self, closing: int) -> dict[str, int]:
        """The ledger of the combine that comes next; ``closing``: micro-batches of a window that closes now
        and is not counted yet."""
        return {"combine": self.combines + 1, "micro-batches": self.window.total + closing,
                "local steps": 0 if self.local is None else self.local.taken}


class Layout:
    """How every rank describes the parameters a window holds, so that the ranks can compare them: each
    one's position among the optimizer's parameters (its identity across ranks), shape and dtype. Cached
    while the parameters and the optimizer's groups stay the same objects."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self._key: tuple | None = None
        self._entries: list[tuple[int, tuple[int, ...], str]] = []
        self._digest = 0

    def of(self, params: list[torch.Tensor]) -> tuple[list, int]:
        """The entries of ``params`` and their digest."""
        everything = [p for g in self.optimizer.param_groups for p in g["params"]]
        key = (tuple(map(id, params)), tuple(map(id, everything)))
        if key != self._key:
            pos: dict[int, int] = {}
            for p in everything:
                pos.setdefault(id(p), len(pos))
            self._entries = [(pos.get(id(p), -1), tuple(p.shape), str(p.dtype).replace("torch.", ""))
                             for p in params]
            self._digest = zlib.crc32(repr(self._entries).encode()) & 0x7FFFFFFF
            self._key = key
        return self._entries, self._digest


def agree(comm: MPI.Intracomm, ledger: dict[str, int], layout: Layout, params: list[torch.Tensor],
          error: str | None, overflowed: bool = False) -> Decision:
    """Collective, before a window's combine changes anything: the failures, the overflow, the ledger and
    the parameters (``layout`` describes them) of every rank (the module docstring). Where the ledgers or
    parameters differ, the returned decision has failed, with a text that names the ranks and numbers."""
    comm = check_comm(comm)
    if comm.Get_size() == 1:
        return Decision(None if error is None else f"rank 0: {error}", overflowed)
    extra = companion_extra(ledger, layout, params)
    entries = layout.of(params)[0]
    vote = 2 if error is not None else (1 if overflowed else 0)
    try:
        with exchange.call_on(comm, _WHAT) as call:
            votes = agree_exchange(call, _WHAT, None, vote, extra=extra)
            if votes < 2:
                return Decision(None, votes == 1)
            return Decision(exchange.failures_in(call, error, _WHAT), True)
    except AdasumMismatchError as e:
        if "disagree on the settings" not in str(e):
            raise  # a rank in another kind of call altogether: the agreement's own text says which
    return Decision(_differences(comm, ledger, entries), overflowed)


def companion_extra(ledger: dict[str, int], layout: Layout, params: list[torch.Tensor]) -> tuple:
    """What the window's agreement compares: the ledger, the number of parameters and their layout."""
    entries, digest = layout.of(params)
    return tuple(ledger.items()) + (("parameters", len(entries)), ("layout", digest))


def differences(comm: MPI.Intracomm, ledger: dict[str, int], entries: list) -> str | None:
    """Collective (every rank found a difference): what differs in the windows, naming the ranks and their
    numbers, or None where the ledgers and parameters are the same on every rank."""
    text = _differences(comm, ledger, entries)
    return None if text == _NO_DIFFERENCE else text


_NO_DIFFERENCE = "the ranks' windows differ"


def _differences(comm: MPI.Intracomm, ledger: dict[str, int], entries: list) -> str:
    """Collective (every rank found the difference): what differs, naming the ranks and their numbers."""
    everyone = exchange.allgather(comm, (dict(ledger), entries), what="the window's differences")
    ledger0, entries0 = everyone[0]
    out = []
    odd = [r for r, (led, _) in enumerate(everyone) if led != ledger0]
    if odd:
        out.append("the ranks' windows differ (a rank skipped or added a step(), or forced another "
                   "boundary): " + ", ".join(f"rank {r} has {everyone[r][0]}" for r in odd)
                   + f", rank 0 has {ledger0}")
    for r, (_, mine) in enumerate(everyone):
        if mine == entries0:
            continue
        i = next((i for i, (a, b) in enumerate(zip(mine, entries0)) if a != b), min(len(mine), len(entries0)))
        out.append(f"the ranks' windows hold other parameters: rank {r}'s {len(mine)}, rank 0's {len(entries0)}; "
                   f"the window's parameter {i} is {_entry(mine, i)} on rank {r} and {_entry(entries0, i)} on "
                   "rank 0 (every rank must train the same parameters: freeze, unfreeze or add groups alike "
                   "on every rank)")
    return "; ".join(out) or _NO_DIFFERENCE


def _entry(entries: list, i: int) -> str:
    if i >= len(entries):
        return "missing"
    pos, shape, dtype = entries[i]
    return f"the optimizer's parameter {pos} (shape {shape}, {dtype})"


def log_skip(comm: MPI.Intracomm, message: str, *args) -> None:
    """Rank 0 logs ``message % args`` (an update skipped on every rank) on the ``adasum`` logger."""
    if comm.Get_rank() == 0:
        _log.warning(message, *args)
