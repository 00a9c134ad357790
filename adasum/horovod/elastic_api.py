"""Horovod's elastic API (``hvd.elastic``) over MPI with ULFM: :func:`run`, :class:`TorchState`,
:class:`ObjectState`, :class:`ElasticSampler`, :class:`HostsUpdatedInterrupt` (:mod:`adasum.torch.elastic`
says what happens at a failure).

``run`` also takes ``on_error="leave"``: a rank whose training function raises leaves the job (its
traceback shown) and the others go on without it, as under ``horovodrun``; by default such an error ends
the whole job.

Ranks that die are dropped and the survivors go on. With ``ADASUM_ELASTIC_REPLACE=1`` the world grows back,
as under ``horovodrun --min-np`` when hosts come back: at the first commit after a shrink,
``state.commit()`` (``check_host_updates()``) raises :class:`HostsUpdatedInterrupt` on every rank, ``run``
starts as many processes as died on the launcher's free slots, and every rank, the new ones too, calls the
training function again after ``state.sync()``, without a roll back (Horovod's meaning). A new process runs
the script from the top: ``hvd.init()`` there makes the state only, its lane follows when it joins in
``run``; until then its collectives raise (``hvd.local_rank()`` too). After a reset ``hvd.size()``,
``hvd.rank()`` (a rank's number may change), the collectives, new ``hvd.DistributedOptimizer`` objects and
the one held by the state work on the new world; process sets other than the global one are gone (register
them again in a reset callback).
"""

from __future__ import annotations

from typing import Any

from ..torch.elastic import AnotherRankRaised, ElasticSampler, HostsUpdatedInterrupt, State, WorldChanged, run

__all__ = ["run", "State", "TorchState", "ObjectState", "ElasticSampler", "WorldChanged", "AnotherRankRaised",
           "HostsUpdatedInterrupt"]


class TorchState(State):
    """Horovod's ``hvd.elastic.TorchState(model, optimizer, **attributes)``: :class:`adasum.torch.elastic.State`."""

    def __init__(self, model=None, optimizer=None, **attributes: Any):
        super().__init__(model, optimizer, **attributes)


class ObjectState(State):
    """Horovod's ``hvd.elastic.ObjectState(**attributes)``: plain picklable attributes only."""

    def __init__(self, **attributes: Any):
        super().__init__(None, None, **attributes)
