"""Shared test set-up. MPI tests carry ``@pytest.mark.mpi`` and run under
``mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi`` (see scripts/run_tests.py)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

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


@pytest.hookimpl(wrapper=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """pytest-mpi ends every ``--with-mpi`` run with an "MPI Information" section (the rank, the size, MPI's
    and mpi4py's versions and configuration: MPICH's library version alone is a dozen lines); the runner
    starts some twenty such runs, so it is left out, unless ``-v`` is given twice."""
    plugins = [p for p in config.pluginmanager.get_plugins() if type(p).__name__ == "MPIPlugin"]
    quiet = [p for p in plugins if getattr(p, "_is_testing_mpi", False) and config.get_verbosity() < 2]
    for plugin in quiet:
        plugin._is_testing_mpi = False  # read by its summary alone, after the tests
    try:
        return (yield)
    finally:
        for plugin in quiet:
            plugin._is_testing_mpi = True


def pytest_runtest_logreport(report):
    """Under ``--with-mpi``, a failure is written out as it happens, with its rank and time: ranks other than
    0 write to their own logs (scripts/run_tests.py), and a job that later hangs or is killed never reaches
    pytest's summary, which is where the reason would otherwise be."""
    if report.passed or report.skipped or not getattr(report, "longreprtext", ""):
        return
    MPI = getattr(sys.modules.get("mpi4py.MPI"), "COMM_WORLD", None) and sys.modules["mpi4py.MPI"]
    if not MPI or not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return
    rank = MPI.COMM_WORLD.Get_rank()
    stamp = time.strftime("%H:%M:%S")
    sys.stderr.write(f"\n----- rank {rank}, {stamp}: {report.nodeid} failed in {report.when} -----\n"
                     f"{report.longreprtext[-6000:]}\n----- end of rank {rank}'s failure -----\n")
    sys.stderr.flush()
    if os.environ.get("ADASUM_TEST_ABORT_ON_FAILURE") == "1":
        # A test that failed on some ranks only left the others inside its collectives: every test after it
        # would meet the wrong collective and fail for no reason of its own, or hang until the timeout.
        sys.stderr.write(f"rank {rank}: ending the job (ADASUM_TEST_ABORT_ON_FAILURE=1)\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


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

