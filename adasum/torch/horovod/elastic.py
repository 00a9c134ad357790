"""Horovod's elastic API (``hvd.elastic``) over MPI with ULFM: :func:`run`, :class:`TorchState`,
:class:`ObjectState` (:mod:`adasum.torch.elastic` says what happens at a failure).

The world cannot grow, as it can under ``horovodrun --min-np``: ranks that die are dropped, the survivors
go on; no host is added. After a reset ``hvd.size()``, ``hvd.rank()``, the collectives, new
``hvd.DistributedOptimizer`` objects and the one held by the state work on the survivors' world; process
sets other than the global one are gone (register them again in a reset callback).
"""

from __future__ import annotations

from typing import Any

from ..elastic import State, WorldChanged, run

__all__ = ["run", "State", "TorchState", "ObjectState", "WorldChanged"]


class TorchState(State):
    """Horovod's ``hvd.elastic.TorchState(model, optimizer, **attributes)``: :class:`adasum.torch.elastic.State`."""

    def __init__(self, model=None, optimizer=None, **attributes: Any):
        super().__init__(model, optimizer, **attributes)


class ObjectState(State):
    """Horovod's ``hvd.elastic.ObjectState(**attributes)``: plain picklable attributes only."""

    def __init__(self, **attributes: Any):
        super().__init__(None, None, **attributes)
