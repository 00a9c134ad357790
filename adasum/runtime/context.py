"""The library's state, one :class:`Context` per user communicator.

Everything the library keeps between calls on a communicator lives in its context: the library's own
duplicate of the communicator, the kept plans (layer tables of recent calls), the kept buffers, the
agreement scratch, the array adapters with their scratch and kept views, the node layout of the hierarchical
mode and the active traffic counters. A context is made on the first call on a communicator (its duplicate
then, collectively),
hangs on that communicator as an MPI attribute, and is freed when the communicator is freed (the attribute's
delete callback) or, its buffers and plans, by :func:`release_buffers`.

A call in flight is a :class:`Call` (``with ctx.call(what) as call:``): the immutable part of one call
(its settings snapshot, waiting mode, the library's communicator, its number) that every function of the
call path takes; the context keeps only what outlives a call.

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
from typing import Any, Iterator, NamedTuple

import numpy as np
from mpi4py import MPI

from ..adapters import Adapters
from .buffers import Buffers
from ..kernels.native import handle
from . import stall
from .errors import NOT_JOINED, AdasumCollectiveError, AdasumNotJoinedError, AdasumStallError
from .faults import is_revoked, pending, revoke_also, world
from ..settings import Settings, current

__all__ = ["Call", "Context", "Traffic", "check_comm", "check_root", "context_for", "count_traffic", "library_comm",
           "live_contexts", "release_buffers"]

# Plans kept per communicator: a training loop reduces a few lists of the same shapes over and over.
MAX_PLANS = 64


@dataclass
class Traffic:
    """Bytes and messages this rank handed to MPI while :func:`count_traffic` was active.

    ``sent_bytes`` counts the vector exchanges; ``scalar_bytes`` the per-level dot-product sums and the
    agreement check; ``allreduce_bytes`` the buffers given to ``MPI_Allreduce`` (sum, mean);
    ``node_bytes`` the buffers given to the collectives inside a node (hierarchical mode: the
    reduce-scatter's input and the slice this rank broadcasts); ``compiled_calls`` the calls that went
    into the compiled small call (:class:`adasum.schedules.small_call.SmallCall`), however they ended;
    ``copied_bytes`` the bytes copied between the caller's tensors and the library's own buffers (packing
    before the collective, writing back after it), which a call that reduces tensors where they lie avoids;
    ``collectives`` the collective operations started (the agreement included; point-to-point messages
    are in ``messages``).
    """

    sent_bytes: int = 0
    messages: int = 0
    scalar_bytes: int = 0
    allreduce_bytes: int = 0
    node_bytes: int = 0
    compiled_calls: int = 0
    copied_bytes: int = 0
    collectives: int = 0


class Call(NamedTuple):
    """One call in flight on a communicator, as :meth:`Context.call` starts it: what every function of the
    call path takes. Immutable; what outlives the call lives in ``ctx``."""

    ctx: "Context"  # the communicator's kept state: buffers, plans, adapters, counters, node layout
    settings: Settings  # the call's snapshot of the settings
    waiting: str  # "nap" or "spin" (adasum.runtime.waiting), resolved from the settings at the start
    lcomm: MPI.Intracomm  # the library's duplicate of the user's communicator
    number: int  # the call's number on this communicator, this rank (the stall inspector's call #N)
    what: str  # what the call is, as errors name it
    companion: Any = None  # a caller's own agreement folded into the call's (adasum.runtime.agreement.Companion)
    shard: Any = None  # the ranks that hold the other pieces of the same layers (their dot products summed)

    def record(self, field: str, nbytes: int, messages: int = 0) -> None:
        """Count ``nbytes`` (and ``messages``) in ``field`` of the active traffic counters."""
        if self.ctx.counters:
            self.ctx.record(field, nbytes, messages)

    def __enter__(self) -> "Call":
        return self

    def __exit__(self, *exc) -> None:
        ctx = self[0]  # the call is over: the communicator takes the next one (Context._end)
        ctx._current = None
        ctx._busy.release()


_new_call = tuple.__new__  # Call(...) without its Python-level __new__: a call's start is on the fast path


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
        # (key, plan) of the plan found or kept last: a loop's next call compares its key with this one's
        # instead of hashing it (hashing numpy's dtypes costs more than the rest of a small call's lookup)
        self.last_plan: tuple = (None, None)
        self.adapters = Adapters()
        self.buffers = Buffers(self.adapters)
        # the agreement: what this rank sends [0:4], what all saw [4:8], a request left waiting [8]
        self.agree_scratch = np.zeros(9, dtype=np.int64)
        self._agree_handles: tuple | None = None
        self.stall_sends: list = []  # the stall inspector's messages in flight
        self.broken: str | None = NOT_JOINED if comm == pending() else None  # why it cannot be used (any more)
        self.counters: list[Traffic] = []
        self.calls = 0  # calls started on this communicator, this rank
        self.extras = None  # (settings, what the ranks agree on besides the tensors), made from those settings
        self.nodes = None  # the node layout (adasum.runtime.topology), made on first use
        # whether the ranks sit on more than one host (shared-memory domain), found with the duplicate
        self.across_hosts = False
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
        never match a receive the application posted on its own communicator. Made at the start of a call
        (:meth:`call`) under its settings; outside a call under the current ones."""
        lcomm = self._lcomm
        return lcomm if lcomm is not None else self._duplicate(current())

    def _duplicate(self, s: Settings) -> MPI.Intracomm:
        with self._dup_lock:
            if self._lcomm is None:
                # Nonblocking, so that the stall inspector can name a rank that does not come.
                lcomm, req = self._comm.Idup()
                making = Call(self, s, self._waiting(s), self._comm, self.calls, "making the library's duplicate")
                stall.wait(making, req, None, None, via=self._comm)
                # Every rank has come (the duplicate is made): one split finds whether the ranks share a
                # host, which the schedule's choice needs (adasum.call.plan.choose).
                node = lcomm.Split_type(MPI.COMM_TYPE_SHARED)
                self.across_hosts = node.Get_size() < self.size
                node.Free()
                self._lcomm = lcomm
            return self._lcomm

    @property
    def agree_handles(self) -> tuple[int, int, int]:
        """The handles of the library's communicator, MPI.INT64_T and MPI.MAX, as the compiled kernels
        take them."""
        if self._agree_handles is None:
            self._agree_handles = (handle(self.lcomm), handle(MPI.INT64_T), handle(MPI.MAX))
        return self._agree_handles

    # --- calls ---------------------------------------------------------------------------------------------
    def call(self, what: str, settings: Settings | None = None, companion=None, shard=None) -> Call:
        """A call on this communicator, for a ``with`` statement (``with ctx.call(what, settings) as call:``,
        which ends it): numbered, the library's duplicate made on the first one (collectively,
        stall-watched), and returned as the immutable :class:`Call` that the call path takes. RuntimeError
        at once if another thread has a call in flight here (two calls on one communicator would mix their
        messages). ``settings`` (default: the current ones, read here) are the call's snapshot: nothing the
        call runs reads the live settings again. ``companion``: what the caller's own agreement adds to the
        call's (:class:`~adasum.runtime.agreement.Companion`). ``shard``: an Adasum call on shards of larger
        layers, the other pieces held by the ranks of that communicator (:func:`adasum.call.allreduce.
        allreduce_sharded_inplace`). Every 64th call first drops the stall inspector's messages of earlier
        calls."""
        if self.broken is not None:
            if self.broken is NOT_JOINED:
                raise AdasumNotJoinedError(f"{what}: {self.broken}")
            if self._freed:  # abandoned after a failure: not a new failure, a stale communicator
                raise AdasumCollectiveError(f"{what} on {self.name}: {self.broken}; use the survivors' world "
                                            "(comm=None, or rebuild in a reset callback)")
            raise AdasumStallError(f"{what} on {self.name}: the library can no longer use this communicator, "
                                   f"an earlier call timed out there ({self.broken})")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"rank {self.rank}: {what} on {self.name} while another thread's call is in flight there "
                f"(call #{self._current[0]}, {self._current[1]}); calls on one communicator must not overlap: "
                "give each thread its own "
                "communicator (comm.Dup()) or serialise the calls")
        self.calls = number = self.calls + 1
        self._current = (number, what)
        try:
            s = current() if settings is None else settings
            lcomm = self._lcomm
            if lcomm is None:
                lcomm = self._duplicate(s)
            how = s.waiting
            call = _new_call(Call, (self, s, ("nap" if self.beside_compute else "spin") if how == "auto" else how,
                                    lcomm, number, what, companion, shard))
            if number % 64 == 0:
                stall.drain(call)
        except BaseException:
            self._end()
            raise
        return call

    def _waiting(self, s: Settings) -> str:
        """How a call under the settings ``s`` waits (``"nap"`` or ``"spin"``; :mod:`adasum.runtime.waiting`)."""
        how = s.waiting
        return ("nap" if self.beside_compute else "spin") if how == "auto" else how

    def _end(self) -> None:
        self._current = None
        self._busy.release()

    # --- kept state ------------------------------------------------------------------------------------------
    def keep(self, key, plan) -> None:
        """Keep ``plan`` under ``key`` (the oldest dropped beyond MAX_PLANS): the plan of a call that
        succeeded on every rank."""
        if len(self.plans) >= MAX_PLANS:
            self.plans.popitem(last=False)
        self.plans[key] = plan
        self.last_plan = (key, plan)

    def record(self, field: str, nbytes: int, messages: int = 0) -> None:
        for t in self.counters:
            setattr(t, field, getattr(t, field) + nbytes)
            t.messages += messages

    def release(self) -> None:
        """Drop the kept buffers, plans and adapter scratch (the next call makes them again)."""
        self.buffers.clear()
        self.plans.clear()
        self.last_plan = (None, None)
        self.adapters.clear()

    def free(self) -> None:
        """Release everything and free the communicators this context made (not where they were revoked:
        :mod:`adasum.runtime.faults`)."""
        if self._freed:
            return
        self._freed = True
        self.release()
        if self.nodes is not None:
            if not is_revoked(self._comm):
                self.nodes.free()
            self.nodes = None
        if MPI.Is_finalized():
            self._lcomm = None
            return
        # The inspector's messages still waiting here would outlive the communicators' contexts and meet
        # the next communicators MPI makes with them (the user's one carried those of the duplicate's
        # making). A revoked communicator is left as it is (adasum.runtime.faults).
        if not is_revoked(self._comm):
            stall.forget(self._comm)
        lcomm = self._lcomm
        if lcomm is not None and lcomm != MPI.COMM_SELF and not is_revoked(lcomm):
            stall.forget(lcomm)
            lcomm.Free()
        self._lcomm = None

    @property
    def user_comm(self) -> MPI.Intracomm:
        """The user's communicator this context belongs to."""
        return self._comm

    def held(self) -> list[MPI.Comm | None]:
        """The communicators this context holds: the user's, the library's duplicate and the node
        layout's (none once freed)."""
        if self._freed:
            return []
        nodes = self.nodes
        layout = [] if nodes is None else [nodes.node_comm, nodes.cross_comm, nodes.slice_comm]
        return [self._comm, self._lcomm, *layout]

    def abandon(self, why: str) -> None:
        """After the world changed (:mod:`adasum.runtime.membership`): every later call raises, saying ``why``;
        nothing is freed (the communicators were revoked, or hold a process that never joined)."""
        self.broken = why
        self._freed = True
        self.release()
        self.nodes = None


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
    """``comm``, or the current world for None (``MPI.COMM_WORLD``, or the survivors' communicator after a
    failure: :mod:`adasum.runtime.faults`); TypeError for anything but an intracommunicator."""
    comm = world() if comm is None else comm
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


def live_contexts() -> list[Context]:
    """Every context alive in this process."""
    return list(_registry.live)


# At a failure every communicator a live context holds is revoked with the world (adasum.runtime.faults).
revoke_also(lambda: [comm for ctx in live_contexts() for comm in ctx.held()])


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

