"""``torch.distributed`` over the MPI world: :func:`init_process_group` starts it from what MPI knows (rank,
size, the node of each rank), so that DDP, Lightning, Accelerate and the Hugging Face Trainer run under
``mpiexec`` as they do under ``torchrun``."""

from __future__ import annotations

import socket

import torch
from mpi4py import MPI

from ..runtime import exchange
from ..runtime.context import check_comm
from ..runtime.launch import check_launch
from ..settings import export_environment, launch_environment
from ..runtime.world import local_rank, local_size

__all__ = ["init_process_group"]


def init_process_group(backend: str | None = None, *, comm: MPI.Intracomm | None = None, timeout=None) -> None:
    """Initialise ``torch.distributed`` on the ranks of ``comm`` (default: the current world,
    ``MPI.COMM_WORLD`` or the survivors' communicator after an elastic shrink); collective.

    Rank and world size come from ``comm``; rank 0 picks its host's address and a free port and broadcasts
    them over MPI (a ``MASTER_ADDR`` set on rank 0 is kept). ``backend`` defaults to ``"nccl"`` where CUDA is available, else ``"gloo"``. The
    variables that launchers such as ``torchrun`` set are exported for frameworks that read them:
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.

    Calling it again is a no-op where ``torch.distributed`` already runs on the same ranks; where it runs
    with another rank or world size, it raises ``RuntimeError`` saying both.
    """
    import torch.distributed as dist

    comm = check_comm(comm)
    check_launch()
    rank, size = comm.Get_rank(), comm.Get_size()
    if dist.is_available() and dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, size):
            raise RuntimeError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, but this is rank {rank} of {size} of the MPI "
                               "communicator; destroy its process group first, or pass the matching comm")
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    hosts = exchange.allgather(comm, socket.gethostname(), what="init_process_group's hosts")
    address = None
    if rank == 0:
        given = launch_environment().get("MASTER_ADDR")  # as the process was started with it
        address = given or ("127.0.0.1" if len(set(hosts)) == 1 else _host_address())
        with socket.socket() as s:
            s.bind(("", 0))
            address = (address, s.getsockname()[1])
    address = exchange.bcast(comm, address, what="init_process_group's address")
    env = {"RANK": rank, "WORLD_SIZE": size, "LOCAL_RANK": local_rank(comm), "LOCAL_WORLD_SIZE": local_size(comm),
           "MASTER_ADDR": address[0], "MASTER_PORT": address[1]}
    export_environment(env)
    kwargs = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=size, **kwargs)


def _host_address() -> str:
    """This host's address as its name resolves (set ``MASTER_ADDR`` where that is not the one to use)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.getfqdn()
