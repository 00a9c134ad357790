"""Horovod's elastic API (``hvd.elastic``) over MPI with ULFM: :func:`run`, :class:`TorchState`,
:class:`ObjectState`, :class:`ElasticSampler` (:mod:`adasum.torch.elastic` says what happens at a failure).

``run`` also takes ``on_error="leave"``: a rank whose training function raises leaves the job (its
traceback shown) and the others go on without it, as under ``horovodrun``; by default such an error ends
the whole job.

The world cannot grow, as it can under ``horovodrun --min-np``: ranks that die are dropped, the survivors
go on; no host is added. After a reset ``hvd.size()``, ``hvd.rank()``, the collectives, new
``hvd.DistributedOptimizer`` objects and the one held by the state work on the survivors' world; process
sets other than the global one are gone (register them again in a reset callback).
"""

from __future__ import annotations

from typing import Any

from ..torch.elastic import AnotherRankRaised, ElasticSampler, State, WorldChanged, run

__all__ = ["run", "State", "TorchState", "ObjectState", "ElasticSampler", "WorldChanged", "AnotherRankRaised"]


class TorchState(State):
    """Horovod's ``hvd.elastic.TorchState(model, optimizer, **attributes)``: :class:`adasum.torch.elastic.State`."""

    def __init__(self, model=None, optimizer=None, **attributes: Any):
        super().__init__(model, optimizer, **attributes)


class ObjectState(State):
    """Horovod's ``hvd.elastic.ObjectState(**attributes)``: plain picklable attributes only."""

    def __init__(self, **attributes: Any):
        super().__init__(None, None, **attributes)
