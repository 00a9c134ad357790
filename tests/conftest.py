"""Shared test set-up. MPI tests carry ``@pytest.mark.mpi`` and run under
``mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi`` (see scripts/run_tests.py)."""

from __future__ import annotations

import pytest


@pytest.fixture
def comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD
