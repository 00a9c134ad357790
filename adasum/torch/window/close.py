"""The close of a training window, written once: every path that combines drives :class:`WindowClose`.

A window closes in five stages, each written here once:

1. **agree**: one small collective (:meth:`WindowClose.decide`) carries what each rank must know of the
   others before anything changes:

   - whether a rank failed (a local step or a hook raised, a wire job failed): then every rank raises;
   - whether a rank's update is not finite or its gradients overflowed under a loss scale;
   - the window's ledger: which combine this is, how many ``step()`` calls, local steps and micro-batches
     each rank counted; a rank that skipped or added a ``step()`` makes every rank raise, naming the ranks
     and their counts;
   - the parameters the window holds (count, shapes, dtypes): a rank whose parameters differ makes every
     rank raise naming the first differing parameter, before any byte of the combine is sent.

   Where the wire's own call starts with an agreement (sum/mean in one call), the window's rides on it as
   its companion: one small collective, not two.
2. **the wire**: the path's deltas or gradients reduced in place (Adasum, sum or mean, through the 16-bit
   wire where asked, hierarchical where asked);
3. **finite**: whether every combined value is finite (voted on where the ranks hold different parts);
4. **apply**: the update (start + combined delta, the outer optimizer's step, or the wrapped optimizer's
   step on the reduced gradients), or every parameter back at the window's start;
5. **count**: the loss scale, the counters (``step_was_skipped``, ``skipped_updates``) and the log line of
   a skipped update.

A path hands the procedure an *update* (its parameters and how to combine, apply and undo them) and drives
:meth:`WindowClose.close`, or the halves :meth:`WindowClose.reduce` and :meth:`WindowClose.apply` where the
stages run apart (``finalize_gradients()`` before ``step()``; the wire during backward with overlap or in
a DDP hook). The paths: the optimizer's boundary with and without overlap
(:mod:`adasum.torch.window.boundary`), local steps and ``delay=1`` (:mod:`adasum.torch.window.local_steps`),
the DDP delta hook (:mod:`adasum.torch.ddp`) and ``ReplicaDeltas`` (:mod:`adasum.torch.fsdp`); the Horovod
optimizer and the Lightning and Hugging Face paths drive the optimizer's. A path may leave out a stage;
none carries its own copy of one.

The update restores what it changed before the procedure raises, so an error leaves every rank where the
window began.
"""

from __future__ import annotations

import logging
import zlib
from typing import Protocol

import torch
from mpi4py import MPI

from ...runtime.agreement import AdasumMismatchError, Companion, agree_exchange, exchange_digest
from ...runtime import exchange
from ...runtime.context import check_comm
from .amp import LossScale
from .tensors import all_finite

__all__ = ["Decision", "Layout", "Ledger", "Update", "WindowClose"]

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

    def __init__(self, window, close: "WindowClose"):
        self.window = window    # the AccumulationWindow: micro-batches recorded and closed
        self.closing = close    # its combines (windows closed with a combine, skipped ones included)
        self.local = None       # LocalSteps, where the optimizer takes local steps

    def at(self, closing: int) -> dict[str, int]:
        """The ledger of the combine that comes next; ``closing``: micro-batches of a window that closes now
        and is not counted yet."""
        return {"combine": self.closing.combines + 1, "micro-batches": self.window.total + closing,
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


def _agree(comm: MPI.Intracomm, ledger: dict[str, int], layout: Layout, params: list[torch.Tensor],
          error: str | None, overflowed: bool = False) -> Decision:
    """Collective, before a window's combine changes anything: the failures, the overflow, the ledger and
    the parameters (``layout`` describes them) of every rank (the module docstring). Where the ledgers or
    parameters differ, the returned decision has failed, with a text that names the ranks and numbers."""
    comm = check_comm(comm)
    if comm.Get_size() == 1:
        return Decision(None if error is None else f"rank 0: {error}", overflowed)
    extra = _companion_extra(ledger, layout, params)
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


def _companion_extra(ledger: dict[str, int], layout: Layout, params: list[torch.Tensor]) -> tuple:
    """What the window's agreement compares: the ledger, the number of parameters and their layout."""
    entries, digest = layout.of(params)
    return tuple(ledger.items()) + (("parameters", len(entries)), ("layout", digest))


def _found_differences(comm: MPI.Intracomm, ledger: dict[str, int], entries: list) -> str | None:
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


class Update(Protocol):
    """What a path hands :class:`WindowClose` for one window: its parameters and how to combine, apply and
    undo them."""

    params: list[torch.Tensor]  # the window's parameters, as the ranks compare them
    voted: bool                 # the ranks hold different parts of the combined values (shards)
    skips_overflowed: bool      # a rank's vote that its update is not finite skips the wire on every rank

    def carries_companion(self, comm: MPI.Intracomm) -> bool:
        """Whether :meth:`combine` starts with an agreement that can carry the window's."""

    def combine(self, comm: MPI.Intracomm, companion: Companion | None) -> None:
        """The wire: the deltas or gradients reduced in place over ``comm``."""

    def settle(self) -> None:
        """After the agreement, on the calling thread: hand what the wire produced to the parameters."""

    def combined(self) -> list[torch.Tensor]:
        """This rank's combined values, all of which must be finite for the update to apply."""

    def apply(self, ok: bool) -> None:
        """The update (``ok``), or every parameter back at the window's start."""

    def explain(self) -> None:
        """Where the values that were not finite came from (a skipped update)."""

    def abandon(self) -> None:
        """Every parameter back at the window's start, nothing left in flight (a failure)."""


class WindowClose:
    """The close of the windows of one training path (one optimizer, ``DeltaState`` or ``ReplicaDeltas``):
    the stages of the module docstring, and the counters they keep.

    ``name`` names the path in log lines and votes; ``failed`` begins every error it raises (what failed,
    and where the parameters are); ``unit`` names a combine in the log line of a skipped one (``"update"``,
    ``"combine"``)."""

    def __init__(self, comm: MPI.Intracomm, layout: Layout, loss: LossScale | None, *, name: str, failed: str,
                 unit: str = "update", skip_nonfinite: bool = True):
        self.comm, self.layout, self.loss = comm, layout, loss
        self.name, self.failed, self.unit, self.skip_nonfinite = name, failed, unit, skip_nonfinite
        self.combines = 0               # windows closed with a combine, skipped ones included
        self.skipped = 0                # of them, skipped for values that were not finite
        self.step_was_skipped = False   # the last one was
        # This rank's update failed after the others applied theirs (the wrapped step raised after a sum or
        # mean): the ranks' models differ, and every later agreement fails on every rank, saying so, until
        # a state is loaded (load_state_dict clears it).
        self.diverged: str | None = None

    # --- 1. agree -------------------------------------------------------------------------------------------

    def agree(self, ledger: dict[str, int], params: list[torch.Tensor], error: str | None = None,
              overflowed: bool = False, comm: MPI.Intracomm | None = None) -> Decision:
        """The window's agreement over ``comm`` (default: the path's), without raising: for a lane's job,
        which hands the decision to the calling thread."""
        return _agree(comm or self.comm, ledger, self.layout, params, error or self.diverged, overflowed)

    def decide(self, ledger: dict[str, int], params: list[torch.Tensor], error: str | None = None,
               overflowed: bool = False, *, undo=None, comm: MPI.Intracomm | None = None,
               context: str | None = None) -> Decision:
        """The window's agreement; where it failed, ``undo()`` and raise on every rank (:meth:`failure`)."""
        decision = self.agree(ledger, params, error, overflowed, comm)
        if decision.failed:
            if undo is not None:
                undo()
            raise self.failure(decision.failed, context)
        return decision

    def failure(self, text: str, context: str | None = None) -> RuntimeError:
        """The error every rank raises: the rank, what failed and where the parameters are, then ``text``."""
        return RuntimeError(f"(raised on rank {self.comm.Get_rank()}) {context or self.failed}: {text}")

    # --- 1 + 2. agree and reduce ------------------------------------------------------------------------------

    def reduce(self, update: Update, ledger: dict[str, int], *, error: str | None = None,
               overflowed: bool = False, reduced: bool = False, comm: MPI.Intracomm | None = None,
               vote_comm: MPI.Intracomm | None = None) -> Decision:
        """The agreement (over ``vote_comm``, default ``comm``) and the wire (over ``comm``, default the
        path's). ``reduced``: the wire ran already (during backward, in a DDP hook), and its errors are in
        ``error``: the agreement follows it. Otherwise it comes first, or rides on the wire's own agreement
        where ``update.carries_companion``."""
        comm = comm or self.comm
        vote_comm = vote_comm or comm
        if reduced:
            decision = self.decide(ledger, update.params, error, overflowed, undo=update.abandon, comm=vote_comm)
            update.settle()
            return decision
        companion = None
        if update.carries_companion(comm):
            extra = _companion_extra(ledger, self.layout, update.params)
            companion = Companion(exchange_digest(_WHAT, extra), extra, error or self.diverged)
            decision = Decision(None, False)
        else:
            decision = self.decide(ledger, update.params, error, overflowed, undo=update.abandon, comm=vote_comm)
            if decision.overflowed and update.skips_overflowed:
                return decision  # nothing worth sending: every rank skips this update
        try:
            update.combine(comm, companion)
        except AdasumMismatchError as e:
            update.abandon()
            if companion is None:
                raise
            raise self._refused(ledger, update.params, e) from None
        except RuntimeError as e:
            update.abandon()
            if companion is not None and error is not None:  # the companion carried this rank's error
                raise self.failure(str(e)) from None
            raise
        except BaseException:
            update.abandon()
            raise
        update.settle()
        return decision

    def _refused(self, ledger: dict[str, int], params: list[torch.Tensor], e: AdasumMismatchError) -> RuntimeError:
        """Every rank's error where the wire's agreement, carrying the window's, found the ranks apart;
        collective where the settings differ (every rank then gathers what differs in the windows)."""
        text = str(e)
        if "disagree on the settings" in text:
            text = _found_differences(self.comm, ledger, self.layout.of(params)[0]) or text
        return self.failure(text)

    # --- 3 + 4 + 5. finite, apply, count ---------------------------------------------------------------------

    def apply(self, update: Update, decision: Decision, scale: float | None) -> bool:
        """Whether every combined value is finite, then the update or the window's start, then the loss
        scale and the counters. Returns False where the update was skipped (on every rank alike)."""
        ok = not (decision.overflowed and update.skips_overflowed)
        if ok and self.skip_nonfinite:
            ok = self.finite(update.combined(), update.voted)
        try:
            update.apply(ok)
        except BaseException as e:
            # The others apply this update: the ranks' models now differ. This rank counts the combine as
            # they do (the ledgers stay in step) and brings the cause to every later agreement.
            self.count(ok, scale, scale_ok=ok and not decision.overflowed)
            self.diverged = (f"rank {self.comm.Get_rank()}: its update {self.combines} failed after the "
                             f"reduction ({type(e).__name__}: {e}), so its parameters and optimizer state "
                             "differ from the other ranks' since; load a state on every rank "
                             "(load_state_dict, or load_checkpoint with the optimizer) to go on")
            raise
        if not ok:
            update.explain()
        return self.count(ok, scale, scale_ok=ok and not decision.overflowed)

    def finite(self, tensors: list[torch.Tensor], voted: bool = False) -> bool:
        """Whether every tensor is finite; ``voted``: on every rank (each holds a different part)."""
        ok = all_finite(tensors)
        if voted:
            ok = not exchange.any_true(self.comm, not ok, f"{self.name}: finite combined values")
        return ok

    def count(self, ok: bool, scale: float | None = None, scale_ok: bool | None = None) -> bool:
        """The loss scale (``scale``: the one the window's gradients carried; it grows where ``scale_ok``,
        default ``ok``, and backs off otherwise), the counters and the log line of a skipped combine;
        returns ``ok``."""
        if self.loss is not None and scale is not None:
            self.loss.update(scale, ok if scale_ok is None else scale_ok)
        self.combines += 1
        self.step_was_skipped = not ok
        if not ok:
            self.skipped += 1
            if self.comm.Get_rank() == 0:
                _log.warning("adasum: %s: %s %d skipped on every rank: the combined values hold a NaN or Inf; "
                             "the parameters are left at the window's start (%d skipped so far)", self.name,
                             self.unit, self.combines, self.skipped)
        return ok

    def close(self, update: Update, ledger: dict[str, int], *, error: str | None = None,
              overflowed: bool = False) -> bool:
        """Every stage, in order (:meth:`reduce`, then :meth:`apply`)."""
        scale = None if self.loss is None else self.loss.current()
        return self.apply(update, self.reduce(update, ledger, error=error, overflowed=overflowed), scale)
