"""What elastic training rolls back to, and brings a newcomer: :class:`State`."""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any, Callable

from ...runtime import exchange
from ...runtime.membership import lost_ranks, shrink, ulfm_problem, world
from ...settings import current
from ..state.broadcast import broadcast_optimizer_state, broadcast_parameters, to_cpu
from .causes import HostsUpdatedInterrupt
from .sharded import sharded_modules

__all__ = ["State"]

_log = logging.getLogger("adasum")
# The library's own counters, kept and synced with the attributes (State._library).
_COUNTERS = ("commits", "resets", "grows", "launch_size", "failed_grows", "grown_at")


class State:
    """What training rolls back to after a failure, and what a newcomer receives: ``model`` (a torch
    module), ``optimizer`` (a :class:`~adasum.torch.DistributedOptimizer` or any torch optimizer) and named
    attributes (``epoch=0``, ``batch=0``: picklable values, read and written as attributes of the state; an
    attribute with ``state_dict()`` and ``load_state_dict()``, such as a learning-rate scheduler, is kept
    through them).

    A copy is kept at construction and at every :meth:`commit`. Attributes:
        commits: commits so far (in the job: a newcomer receives the count).
        resets: failures survived so far.
        grows: times the world grew back to its launch size (``elastic_replace``).
        launch_size: the world's size when training began (set by :func:`run`).
        failed_grows: attempts at growing back that failed since the last death or the last growth that
            lasted to a commit (a death before the first commit after a growth counts as one).
        grown_at: :attr:`commits` when the world last grew back (-1: never).
        last_recovery_seconds: of the last failure, the seconds from its detection on this rank to the
            training function being called again (shrink, rebuild, restore, callbacks and sync).
        last_failure_seen_at, last_resumed_at: of the last failure, when (``time.time()``) this rank saw
            it, and when the training function was called again.
        last_grown_at, last_grow_seconds: of the last growth, when (``time.time()``) training went on at
            the launch size, and the seconds from the commit that started it.
    """

    def __init__(self, model=None, optimizer=None, **attributes: Any):
        self.model, self.optimizer = model, optimizer
        self._names = tuple(attributes)
        for name, value in attributes.items():
            setattr(self, name, value)
        self._callbacks: list[Callable[[], None]] = []
        self.commits = self.resets = self.grows = self.failed_grows = 0
        self.grown_at = -1
        self.launch_size: int | None = None
        self.last_recovery_seconds: float | None = None
        self.last_failure_seen_at: float | None = None
        self.last_resumed_at: float | None = None
        self.last_grown_at: float | None = None
        self.last_grow_seconds: float | None = None
        self._in_run = False  # inside elastic.run: check_host_updates() may interrupt
        self._saved: dict[str, Any] = {}
        self._save()

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` (no arguments) after every reset, in order: for what depends on the
        world's size (the learning rate, the data's sharding, a sampler). A reset is a shrink after a
        death, and a growth back to the launch size; a newcomer runs them once it joined. They see the new
        world (``adasum.size()``, ``adasum.rank()``: a rank's number may change) and, before the state is
        synced from rank 0, this rank's own state."""
        self._callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks."""
        for callback in self._callbacks:
            callback()

    def commit(self) -> None:
        """Collective: close and combine the optimizer's open window (its ``flush()``), then keep a copy of
        model, optimizer and attributes in memory, which a failure rolls back to; then
        :meth:`check_host_updates`."""
        flush = getattr(self.optimizer, "flush", None)
        if flush is not None:
            flush()
        self.commits += 1
        if self.commits == self.grown_at + 1:
            self.failed_grows = 0  # the world that grew back lasted to a commit
        self._save()
        self._check(flushed=True)

    def save(self) -> None:
        """Keep a copy of model, optimizer and attributes (local; :meth:`commit` flushes first)."""
        self._save()

    def check_host_updates(self) -> None:
        """Horovod's check for a change of the world: inside :func:`run`, where the world is to grow back
        now (``elastic_replace`` on, fewer ranks than at launch, attempts left), raise
        :class:`HostsUpdatedInterrupt` on every rank, after closing the optimizer's open window (collective,
        as :meth:`commit`): ``run`` then starts the missing processes, and every rank, the newcomers too,
        calls the training function again from this state. Otherwise nothing (local)."""
        self._check(flushed=False)

    def _check(self, flushed: bool) -> None:
        if not self._grow_due():
            return
        flush = getattr(self.optimizer, "flush", None)
        if flush is not None and not flushed:
            flush()
        raise HostsUpdatedInterrupt(skip_sync=False)

    def _grow_due(self) -> bool:
        """Whether the world is to grow back now: the same on every rank (settings checked alike, counters
        synced)."""
        s = current()
        return (self._in_run and s.elastic_replace and self.launch_size is not None
                and world().Get_size() < self.launch_size and self.failed_grows < s.elastic_replace_attempts
                and ulfm_problem() is None)

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
        """Collective over the current world: the parameters and buffers, the optimizer's state, the
        attributes and the counters (:attr:`commits`, …) of its rank 0 on every rank, kept as the last
        commit too (a :meth:`restore` after it gives rank 0's state, as Horovod's ``sync`` does). Of a
        :class:`~adasum.torch.DistributedOptimizer` the whole
        :meth:`~adasum.torch.DistributedOptimizer.state_dict` (its counters too): a rank that died inside a
        commit may have let some survivors finish it and not others, and rank 0's commit is then
        everyone's; a newcomer receives it all here. Of a sharded model (FSDP2, HSDP) the attributes and
        counters only: each rank holds its own shards."""
        if not sharded_modules(self.model):  # a sharded model's ranks each hold their own shards
            self._sync_model_and_optimizer()
        values, counters = exchange.bcast(world(), (self._values(), self._library()), root=0,
                                          what="the elastic state's attributes")
        self._load_values(values)
        for name, value in counters.items():
            setattr(self, name, value)
        self._save()

    def _sync_model_and_optimizer(self) -> None:
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

    def _library(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _COUNTERS}

    def rejoin(self) -> None:
        """Rebuild what holds the old world on the current one: the optimizer, then the model, each that has
        a ``rejoin()`` (a :class:`~adasum.torch.DistributedOptimizer`, an
        :class:`~adasum.torch.elastic.ElasticDDP`)."""
        for part in (self.optimizer, self.model):
            rejoin = getattr(part, "rejoin", None)
            if callable(rejoin):
                rejoin(world())

    def reset(self, detected: float) -> None:
        """After a failure seen at ``detected`` (``time.monotonic()``): shrink the world, rebuild, roll back
        to the last commit and run the reset callbacks. Collective over the survivors."""
        before, group = world().Get_size(), world().Get_group()
        shrink()
        gone = lost_ranks(group, world())
        group.Free()
        self._roll_back(before, detected, gone)

    def _roll_back(self, before: int, detected: float, gone: list[int] | None = None) -> None:
        """Once the world shrank from ``before`` ranks (``gone``: which, in that world's numbering): rebuild,
        roll back, run the reset callbacks, log."""
        self.resets += 1  # counted once the world shrank: a death during the rest is a reset of its own
        if self.commits == self.grown_at:
            # No commit since the world grew back: the growth did not last (a replacement that dies every
            # time it joins), so it counts against elastic_replace_attempts instead of starting afresh.
            self.failed_grows += 1
            self.grown_at = -1  # the next commit is not one of a grown world
            if world().Get_rank() == 0:
                attempts = current().elastic_replace_attempts
                _log.warning("adasum: a rank died before the first commit after the world grew back: growing "
                             "back counts as failed (attempt %d of %d%s)", self.failed_grows, attempts,
                             "; no more attempts until another rank dies" if self.failed_grows >= attempts else "")
        else:
            self.failed_grows = 0  # a new loss: growing back is tried afresh
        self.rejoin()
        self.restore()
        self._drop_gradients()
        self.on_reset()
        which = f" (rank{'s' * (len(gone) != 1)} {', '.join(map(str, gone))} of the {before})" if gone else ""
        _log.warning("adasum: rank %d: a rank died%s; the world shrank from %d to %d ranks and went back to the "
                     "last commit (reset %d, %.2f s)", world().Get_rank(), which, before, world().Get_size(),
                     self.resets, time.monotonic() - detected)

    def _drop_gradients(self) -> None:
        """The gradients of the work since the commit are gone with it (a backward the failure cut short
        leaves some): every gradient of the model's and the optimizer's parameters set to None, so that the
        next backward starts afresh even where the loop zeroes them only after its step."""
        params = list(self.model.parameters()) if callable(getattr(self.model, "parameters", None)) else []
        groups = getattr(self.optimizer, "param_groups", None) or []
        for p in params + [p for g in groups for p in g["params"]]:
            p.grad = None

    def _grown(self, before: int, started: float, newcomer: bool) -> None:
        """Once the world grew from ``before`` ranks (this rank a survivor, or a newcomer that joined):
        rebuild, run the reset callbacks, log. Nothing to roll back: the survivors are at the commit."""
        self.rejoin()
        self.on_reset()
        me = world().Get_rank()
        if newcomer:
            _log.info("adasum: rank %d: joined the job as rank %d of %d (pid %d, started in place of a rank "
                      "that died)", me, me, world().Get_size(), os.getpid())
        elif me == 0:
            _log.warning("adasum: the world grew back from %d to %d ranks at the commit (%.2f s so far)",
                         before, world().Get_size(), time.monotonic() - started)


def _stateful(obj) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
