"""What :func:`~adasum.torch.elastic.run` makes of an error, and what it does with one: a rank's death,
another rank's exception (:class:`AnotherRankRaised`), the world growing back
(:class:`HostsUpdatedInterrupt`), and the rank that raised (told, then ended where the others cannot hear
of it)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback

import torch.distributed as dist
from mpi4py import MPI

from ...runtime.errors import AdasumCollectiveError, AdasumNotJoinedError, AdasumStallError
from ...runtime.membership import WorldChanged, kill_silent, revoke_all, world
from .process_group import drop_process_groups

__all__ = ["AnotherRankRaised", "HostsUpdatedInterrupt", "NotJoinedError", "TELL_PATIENCE"]

NotJoinedError = AdasumNotJoinedError
_log = logging.getLogger("adasum")


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's interrupt for a change of the world: raised by ``State.commit()`` and
    ``State.check_host_updates()`` on every rank where the world is to grow back; :func:`run` catches it,
    starts the missing processes and calls the training function again from the state as it is (no roll
    back; the newcomers receive it). ``skip_sync``: whether that call may skip ``State.sync()`` (Horovod's
    meaning; always False here, where the world grows)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the world is to grow back: elastic.run starts the missing processes")
        self.skip_sync = skip_sync


# Seconds a rank that raised waits for the others to hear of it (they must reach a call of the library, or
# a call on the world, which then fails at once) before it dies of SIGKILL: Open MPI then reports it dead and
# the others go on without it, rather than wait for it for ever.
TELL_PATIENCE = 120.0


class AnotherRankRaised(RuntimeError):
    """Raised by :func:`run` on every rank whose training function did not fail when another rank's did:
    the job ends (``on_error="end"``). ``ranks`` are the ranks (of ``MPI.COMM_WORLD``) that raised and
    ``errors`` what they raised (one line each); their tracebacks are in their own output."""

    def __init__(self, text: str, ranks: list[int], errors: list[str]):
        super().__init__(text)
        self.ranks, self.errors = ranks, errors


def _summary(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 500 else text[:497] + "..."


def _cause(exc: BaseException) -> str:
    """What ``exc``, caught by :func:`run` on this rank, says: ``"death"`` (a rank died: a
    :class:`WorldChanged`, an MPI error of the failure classes, as raised or as the text a thread carried
    back), ``"maybe"`` (another MPI error, a stall, a communicator the library gave up: a rank may have
    died, which the shrink that follows finds out) or ``"raised"`` (an error of the training function
    itself: the job ends, or this rank leaves, as ``on_error`` says)."""
    seen: set[int] = set()
    maybe = False
    death = False
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MPI.Exception):
            return "death" if exc.Get_error_class() in _failure_classes() else "maybe"
        text = str(exc)
        if any(name in text for name in ("MPI_ERR_PROC_FAILED", "MPI_ERR_REVOKED", "MPIX_ERR_PROC_FAILED",
                                         "MPIX_ERR_REVOKED", "WorldChanged")):
            return "death"
        if "MPI_ERR" in text or isinstance(exc, AdasumCollectiveError) and not isinstance(exc, WorldChanged):
            maybe = True
        if _torch_distributed_error(exc, text):  # gloo's connection to a rank that died or left a collective
            maybe = True
        if isinstance(exc, WorldChanged):
            death = True
        exc = exc.__cause__ or exc.__context__
    return "death" if death else "maybe" if maybe else "raised"


def _torch_distributed_error(exc: BaseException, text: str) -> bool:
    """Whether ``exc`` is an error of a ``torch.distributed`` process group (its store, its connections, a
    collective of gloo or NCCL): a rank may have died (a process group knows nothing of deaths)."""
    kinds = tuple(k for k in (getattr(dist, "DistError", None),) if k is not None)
    return isinstance(exc, kinds) or "gloo" in text.lower() or "Connection closed by peer" in text


def _failure_classes() -> set[int]:
    names = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
    return {c for c in (getattr(MPI, n, None) for n in names) if c is not None and c not in (MPI.ERR_UNKNOWN,
                                                                                            MPI.ERR_OTHER)}


class _Fault:
    """What :func:`run` knows of the fault it recovers from, on this rank."""

    def __init__(self) -> None:
        self.detected = time.monotonic()
        self.size = world().Get_size()  # of the world the fault was met in
        self.own: BaseException | None = None  # this rank's training function raised this
        self.maybe: BaseException | None = None  # an error that a death may explain (_cause "maybe")
        self.deadline: threading.Timer | None = None

    def met(self, exc: BaseException) -> None:
        """Note ``exc``, met in the training function or in the recovery, and make every other rank leave
        the call it is in (the communicators revoked); a stall timeout's silent ranks on this host killed."""
        cause = _cause(exc)
        if isinstance(exc, AdasumStallError):
            killed = kill_silent(exc)
            if killed:
                _log.warning("adasum: rank %d: rank%s %s of the world did not answer for stall_timeout seconds; "
                             "killed, so that the others go on without %s", world().Get_rank(),
                             "s" * (len(killed) != 1), ", ".join(map(str, killed)),
                             "it" if len(killed) == 1 else "them")
        if cause == "raised" and self.own is None:
            self.own = exc
        elif cause == "maybe" and self.maybe is None:
            self.maybe = exc
        revoke_all()
        drop_process_groups()  # a rank waiting for this one in a gloo collective leaves it too

    def arm(self) -> None:
        """A rank that raised: say so at once (the traceback comes when the exception leaves ``run``), and
        die of SIGKILL if the others cannot be told within ``TELL_PATIENCE`` seconds."""
        if self.own is None or self.deadline is not None:
            return
        rank = MPI.COMM_WORLD.Get_rank()
        print(f"adasum: rank {rank}: {_summary(self.own)} (raised inside the elastic training function; "
              "telling the other ranks, the job ends)", file=sys.stderr, flush=True)
        self.deadline = threading.Timer(TELL_PATIENCE, _die, args=(self.own,))
        self.deadline.daemon = True
        self.deadline.start()

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()


def _die(exc: BaseException) -> None:
    print(f"adasum: rank {MPI.COMM_WORLD.Get_rank()}: the other ranks did not take part in ending the job "
          f"within {TELL_PATIENCE:.0f} s; this rank dies of SIGKILL so that they go on without it. It "
          "raised:", file=sys.stderr, flush=True)
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _leave_now(exc: BaseException) -> None:
    """``on_error="leave"``: this rank's training function raised ``exc``: show it and die of SIGKILL, which
    the others see as a rank's death and go on without it (as Horovod's elastic mode drops a failed worker)."""
    print(f"adasum: rank {MPI.COMM_WORLD.Get_rank()}: the elastic training function raised; this rank leaves "
          "the job (on_error='leave') and the others go on without it:", file=sys.stderr, flush=True)
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)
