"""``torch.distributed`` in elastic training: the default process group follows the world.

A process group of gloo (or NCCL) knows nothing of a rank's death: a collective with a dead peer ends with
a connection error at best, and a peer that is alive but has left the collective (it met the death in
another call) is waited for until the group's timeout. So when :func:`~adasum.torch.elastic.run` meets a
failure, :func:`drop_process_groups` destroys this process's groups first (the torch counterpart of
revoking the MPI communicators: a survivor waiting for this rank in a gloo collective sees its connections
close and leaves the call); once the world shrank or grew, :func:`restart_process_group` starts the default
group again on the new world, its rendezvous address agreed over MPI
(:func:`adasum.torch.init_process_group`). :class:`~adasum.torch.elastic.ElasticDDP` does both for a DDP
model.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch.distributed as dist

from ...runtime.membership import world
from ..distributed import init_process_group

__all__ = ["restart_process_group", "drop_process_groups"]

_log = logging.getLogger("adasum")


def drop_process_groups() -> str | None:
    """Destroy every ``torch.distributed`` process group of this process (local; nothing where none was
    started). Returns the backend the default group had (to start the next one with), or None."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    backend = None
    try:
        backend = str(dist.get_backend())
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - a group whose peer died may fail to shut down cleanly
        _log.debug("adasum: rank %d: destroying torch's process groups after a failure: %s", world().Get_rank(),
                   exc)
    return backend


def restart_process_group(backend: str | None = None, *, timeout: timedelta | None = None) -> None:
    """Collective over the current world (:func:`adasum.torch.elastic.world`): the default
    ``torch.distributed`` process group started again on it, where it is not already there (a group of
    another size or rank, or none, as after a failure: :func:`drop_process_groups`). The old group and
    every group made from it are destroyed; rank 0 of the new world picks the rendezvous address and
    broadcasts it over MPI. ``backend`` defaults to the old group's (else ``"nccl"`` with CUDA, ``"gloo"``
    without), ``timeout`` bounds every collective of the new group and its rendezvous (torch's default
    where None). Groups made with ``new_group`` and device meshes must be made again afterwards."""
    comm = world()
    if dist.is_available() and dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) == (comm.Get_rank(), comm.Get_size()):
            return  # a failure drops the groups (run does): one of the world's size is the world's
        dropped = drop_process_groups()
        backend = backend or dropped
    init_process_group(backend, comm=comm, timeout=timeout)

