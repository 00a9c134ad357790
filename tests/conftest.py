"""Shared test set-up. MPI tests carry ``@pytest.mark.mpi`` and run under
``mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi`` (see scripts/run_tests.py)."""

from __future__ import annotations

import shutil
import tempfile

import pytest


def pytest_collection_modifyitems(config, items):
    """Under ``--with-mpi``, a test marked ``world_size(n, ...)`` runs only at those world sizes (its subject
    does not depend on the size, so one size is enough); elsewhere it is deselected, not skipped."""
    if not config.getoption("--with-mpi", default=False):
        return
    from mpi4py import MPI

    size = MPI.COMM_WORLD.Get_size()
    keep, drop = [], []
    for item in items:
        mark = item.get_closest_marker("world_size")
        (drop if mark is not None and size not in mark.args else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.fixture
def stall_comm(comm):
    """A communicator of its own (a stall ends the library's use of it) with a short stall timeout."""
    import adasum

    old = adasum.configure(stall_timeout=3.0, stall_warning=None)
    dup = comm.Dup()
    yield dup
    adasum.configure(old)
    comm.Barrier()
    dup.Free()  # with the library's duplicate of it (a test suite makes more communicators than MPI keeps)


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

