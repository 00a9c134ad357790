"""The library's state, one :class:`Context` per user communicator.

Everything the library keeps between calls on a communicator lives in its context: the library's own
duplicate of the communicator, the kept plans (layer tables of recent calls), the kept buffers, the
agreement scratch, the array adapters with their scratch and kept views, the node layout of the hierarchical
mode and the active traffic counters. A context is made on the first call on a communicator (its duplicate then, collectively),
hangs on that communicator as an MPI attribute, and is freed when the communicator is freed (the attribute's
delete callback) or, its buffers and plans, by :func:`release_buffers`.

Calls on different communicators share nothing but the immutable settings, so they may run in different
threads at the same time. Calls on one communicator must not overlap: the context says so at once.
"""

from __future__ import annotations

import collections
import contextlib
import operator
import threading
import weakref
from dataclasses import dataclass
from typing import Iterator

import numpy as np
from mpi4py import MPI

from ..adapters import Adapters
from ..adapters.base import host_numpy
from ..kernels.native import handle
from . import stall
from .stall import AdasumStallError
from .settings import Settings, current

__all__ = ["Context", "Traffic", "check_comm", "check_root", "context_for", "count_traffic", "library_comm", "release_buffers"]

# Plans kept per communicator: a training loop reduces a few lists of the same shapes over and over.
MAX_PLANS = 64


@dataclass
class Traffic:
    """Bytes and messages this rank handed to MPI while :func:`count_traffic` was active.

    ``sent_bytes`` counts the vector exchanges; ``scalar_bytes`` the per-level dot-product sums and the
    agreement check; ``allreduce_bytes`` the buffers given to ``MPI_Allreduce`` (sum, mean);
    ``node_bytes`` the buffers given to the collectives inside a node (hierarchical mode: the
    reduce-scatter's input and the slice this rank broadcasts); ``compiled_calls`` the calls that went
    into the compiled small call (:class:`adasum.schedules.doubling.SmallCall`), however they ended.
    """

    sent_bytes: int = 0
    messages: int = 0
    scalar_bytes: int = 0
    allreduce_bytes: int = 0
    node_bytes: int = 0
    compiled_calls: int = 0


class Buffers:
    """The buffers a context keeps between calls, one per (slot, array kind, device, dtype), each grown to
    the largest request and shared by all plans: the receive buffer of the schedules (half the largest fused
    buffer for halving at a power-of-two number of ranks; all of it for doubling, and on the rank that takes
    a folded-out partner's vector), the fused buffer of in-place calls that need one, the float32
    buffers of the hierarchical mode's 16-bit sums, and the page-locked host buffers of staged transfers."""

    def __init__(self) -> None:
        self._kept: dict[tuple, list] = {}

    def entry(self, key: tuple) -> list:
        """The kept ``[buffer, numpy view of it or None]`` of ``key``, ``[None, None]`` until first used. An
        entry is updated in place when its buffer is replaced or released, so a holder of the entry never
        keeps an old buffer alive."""
        entry = self._kept.get(key)
        if entry is None:
            entry = self._kept[key] = [None, None]
        return entry

    def get(self, adapters: Adapters, kind: str, device: str, dtype: str, n: int, slot: str):
        """``n`` elements of a kept flat buffer of ``kind`` (as ``adapters`` make it), on ``device``."""
        entry = self.entry((slot, kind, device, dtype))
        if entry[0] is None or len(entry[0]) < n:
            entry[1] = None
            entry[0] = None  # the old buffer goes before the new one is made
            entry[0] = adapters.of(kind).empty(max(n, 1), dtype, device)
        buf = entry[0]
        return buf if len(buf) == n else buf[:n]

    def host(self, adapters: Adapters, kind: str, dtype: str, n: int, slot: str) -> np.ndarray:
        """:meth:`get` of a host buffer, as a numpy array (the same memory, for torch CPU buffers)."""
        entry = self.entry((slot, kind, "cpu", dtype))
        view = entry[1]
        if view is None or len(view) < n:
            self.get(adapters, kind, "cpu", dtype, n, slot)
            view = entry[1] = host_numpy(entry[0])
        return view if len(view) == n else view[:n]

    def staging(self, adapters: Adapters, kind: str, device: str, which: int, nbytes: int) -> np.ndarray:
        """Host bytes for staged transfers of ``kind``/``device`` buffers (``which``: 0 send, 1 receive),
        page-locked where the device has such memory."""
        entry = self.entry(("staging", kind, device, which))
        if entry[0] is None or entry[0].nbytes < nbytes:
            entry[0] = None
            entry[0] = adapters.of(kind).host_bytes_empty(max(nbytes, 1 << 16), device)
        return entry[0][:nbytes]

    def clear(self) -> None:
        for entry in self._kept.values():
            entry[0] = entry[1] = None
        self._kept.clear()


class Context:
    """The library's state on one user communicator (see the module docstring)."""

    def __init__(self, comm: MPI.Intracomm):
        self.name = _describe(comm)
        self._comm = comm
        self._lcomm: MPI.Intracomm | None = comm if comm == MPI.COMM_SELF else None
        self._dup_lock = threading.Lock()
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.plans: collections.OrderedDict = collections.OrderedDict()
        self.buffers = Buffers()
        self.adapters = Adapters()
        # the agreement: what this rank sends [0:4], what all saw [4:8], a request left waiting [8]
        self.agree_scratch = np.zeros(9, dtype=np.int64)
        self._agree_handles: tuple | None = None
        self.stall_sends: list = []  # the stall inspector's messages in flight
        self.broken: str | None = None  # why the library's communicator cannot be used any more
        self.counters: list[Traffic] = []
        self.calls = 0  # calls started on this communicator, this rank
        self.settings: Settings | None = None  # the snapshot of the call in flight (None between calls)
        self.extras = None  # (settings, what the ranks agree on besides the tensors), made from those settings
        self.nodes = None  # the node layout (adasum.runtime.topology), made on first use
        self._busy = threading.Lock()
        self._current: tuple | None = None  # (call number, what) of the call in flight
        self._freed = False
        # Waited on by a thread beside the compute (the overlap thread): under waiting="auto" its waits nap.
        self.beside_compute = False
        # Its owner may give it up while a thread waits there (the overlap engine's; see adasum.runtime.stall).
        self.may_give_up = False

    @property
    def lcomm(self) -> MPI.Intracomm:
        """The library's duplicate of the user's communicator, made (collectively) on first use: our messages
        never match a receive the application posted on its own communicator."""
        lcomm = self._lcomm
        if lcomm is None:
            with self._dup_lock:
                if self._lcomm is None:
                    # Nonblocking, so that the stall inspector can name a rank that does not come.
                    lcomm, req = self._comm.Idup()
                    stall.wait(self, req, None, None, via=self._comm)
                    self._lcomm = lcomm
                lcomm = self._lcomm
        return lcomm

    def has_lcomm(self) -> bool:
        return self._lcomm is not None

    @property
    def agree_handles(self) -> tuple[int, int, int]:
        """The handles of the library's communicator, MPI.INT64_T and MPI.MAX, as the compiled kernels
        take them."""
        if self._agree_handles is None:
            self._agree_handles = (handle(self.lcomm), handle(MPI.INT64_T), handle(MPI.MAX))
        return self._agree_handles

    # --- calls ---------------------------------------------------------------------------------------------
    def enter(self, what: str, settings: Settings | None = None) -> int:
        """Start a call on this communicator (end it with :meth:`leave`, in a ``finally``): numbers it, and
        raises RuntimeError at once if another thread has a call in flight here (two calls on one
        communicator would mix their messages). ``settings`` (default: the current ones, read here) are the
        call's snapshot: :attr:`settings` and the adapters hold it until :meth:`leave`, and nothing the
        call runs reads the live settings again."""
        if self.broken is not None:
            raise AdasumStallError(f"{what} on {self.name}: the library can no longer use this communicator, "
                                   f"an earlier call timed out there ({self.broken})")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"rank {self.rank}: {what} on {self.name} while another thread's call is in flight there "
                f"(call #{self._current[0]}, {self._current[1]}); calls on one communicator must not overlap: "
                "give each thread its own "
                "communicator (comm.Dup()) or serialise the calls")
        self.calls += 1
        self._current = (self.calls, what)
        self.settings = settings if settings is not None else current()
        self.adapters.use(self.settings)
        return self.calls

    def waiting(self) -> str:
        """How the call in flight waits (``"nap"`` or ``"spin"``; see :mod:`adasum.runtime.waiting`)."""
        how = self.settings.waiting if self.settings is not None else current().waiting
        return ("nap" if self.beside_compute else "spin") if how == "auto" else how

    def leave(self) -> None:
        self._current = None
        self.settings = None
        self._busy.release()

    # --- kept state ------------------------------------------------------------------------------------------
    def keep(self, key, plan) -> None:
        """Keep ``plan`` under ``key`` (the oldest dropped beyond MAX_PLANS): the plan of a call that
        succeeded on every rank."""
        if len(self.plans) >= MAX_PLANS:
            self.plans.popitem(last=False)
        self.plans[key] = plan

    def record(self, field: str, nbytes: int, messages: int = 0) -> None:
        for t in self.counters:
            setattr(t, field, getattr(t, field) + nbytes)
            t.messages += messages

    def release(self) -> None:
        """Drop the kept buffers, plans and adapter scratch (the next call makes them again)."""
        self.buffers.clear()
        self.plans.clear()
        self.adapters.clear()

    def free(self) -> None:
        """Release everything and free the communicators this context made."""
        if self._freed:
            return
        self._freed = True
        self.release()
        if self.nodes is not None:
            self.nodes.free()
            self.nodes = None
        if self._lcomm is not None and self._lcomm != MPI.COMM_SELF and not MPI.Is_finalized():
            self._lcomm.Free()
        self._lcomm = None


def _describe(comm: MPI.Intracomm) -> str:
    if comm == MPI.COMM_WORLD:
        return "MPI.COMM_WORLD"
    if comm == MPI.COMM_SELF:
        return "MPI.COMM_SELF"
    name = comm.Get_name()
    return f"communicator {name!r}" if name else f"a communicator of {comm.Get_size()} ranks"


class _Registry:
    """The live contexts (for :func:`release_buffers`) and the MPI attribute key they hang on."""

    def __init__(self) -> None:
        self.keyval: int | None = None
        self.live: "weakref.WeakSet[Context]" = weakref.WeakSet()
        self.lock = threading.Lock()

    def key(self) -> int:
        if self.keyval is None:
            with self.lock:
                if self.keyval is None:
                    self.keyval = MPI.Comm.Create_keyval(delete_fn=_on_free)
        return self.keyval


def _on_free(comm, keyval, ctx) -> int:
    """The attribute delete callback: the user's communicator is being freed, so is its context."""
    ctx.free()
    return MPI.SUCCESS


_registry = _Registry()


def check_comm(comm: MPI.Intracomm | None) -> MPI.Intracomm:
    """``comm``, or ``MPI.COMM_WORLD`` for None; TypeError for anything but an intracommunicator."""
    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py intracommunicator, got {type(comm).__name__}")
    return comm


def check_root(comm: MPI.Intracomm, root, name: str = "root") -> int:
    """``root`` (any integer, numpy's too, but not a bool) as an int if it is a rank of ``comm``; ValueError
    saying the valid range otherwise."""
    try:
        value = None if isinstance(root, bool) else operator.index(root)
    except TypeError:
        value = None
    if value is None or not 0 <= value < comm.Get_size():
        raise ValueError(f"{name} must be a rank of comm (0 to {comm.Get_size() - 1}), got {root!r}")
    return value


def context_for(comm: MPI.Intracomm | None) -> Context:
    """The context of ``comm`` (default ``MPI.COMM_WORLD``), made on first use: collective then, since it
    duplicates the communicator."""
    comm = check_comm(comm)
    key = _registry.keyval
    if key is None:
        key = _registry.key()
    ctx = comm.Get_attr(key)
    if ctx is None:
        with _registry.lock:  # two threads on one new communicator get one context
            ctx = comm.Get_attr(key)
            if ctx is None:
                ctx = Context(comm)
                comm.Set_attr(key, ctx)
                _registry.live.add(ctx)
    return ctx


def library_comm(comm: MPI.Intracomm | None = None) -> MPI.Intracomm:
    """The library's duplicate of ``comm``: its messages never meet the application's."""
    return context_for(comm).lcomm


def release_buffers(comm: MPI.Intracomm | None = None) -> None:
    """Free what the library keeps between calls: buffers, plans and scratch, of every communicator (or of
    ``comm`` only). Nothing is lost: the next call makes what it needs again. Call it from the thread that
    makes the library's calls (or when no call is in flight)."""
    targets = [context_for(comm)] if comm is not None else list(_registry.live)
    for ctx in targets:
        ctx.release()


@contextlib.contextmanager
def count_traffic(comm: MPI.Intracomm | None = None) -> Iterator[Traffic]:
    """Count what this rank sends in calls on ``comm`` (default ``MPI.COMM_WORLD``) inside the block::

        with adasum.count_traffic() as t:
            adasum.adasum_allreduce(grads)
        print(t.sent_bytes)
    """
    ctx = context_for(comm)
    t = Traffic()
    ctx.counters.append(t)
    try:
        yield t
    finally:
        ctx.counters.remove(t)

