"""Shared test set-up. MPI tests carry ``@pytest.mark.mpi`` and run under
``mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi`` (see scripts/run_tests.py)."""

from __future__ import annotations

import os

import pytest

# Under scripts/run_tests.py every rank but 0 writes its report to a log, shown only if its run fails.
_logdir = os.environ.get("ADASUM_TEST_LOGDIR")
if _logdir:
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() != 0:
        _fd = os.open(os.path.join(_logdir, f"rank{MPI.COMM_WORLD.Get_rank()}.log"),
                      os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(_fd, 1)
        os.dup2(_fd, 2)


@pytest.fixture
def comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD
