"""Shared test set-up. MPI tests carry ``@pytest.mark.mpi`` and run under
``mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi`` (see scripts/run_tests.py)."""

from __future__ import annotations

import shutil
import tempfile

import pytest


@pytest.fixture
def comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.fixture
def shared_dir(comm):
    """A directory every rank sees (made by rank 0, removed after the test)."""
    path = comm.bcast(tempfile.mkdtemp(prefix="adasum-ckpt-") if comm.Get_rank() == 0 else None, root=0)
    yield path
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def pg():
    """torch.distributed started from MPI (gloo) for a module's tests, and destroyed after them, so that no
    process group is left for the interpreter's exit."""
    import torch.distributed as dist
    from mpi4py import MPI

    import adasum.torch as at

    at.init_process_group("gloo", comm=MPI.COMM_WORLD)
    yield
    MPI.COMM_WORLD.Barrier()
    if dist.is_initialized():
        dist.destroy_process_group()

