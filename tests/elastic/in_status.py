"""A wait on several requests meets a dead rank: mpi4py raises ``MPI_ERR_IN_STATUS`` (the requests' own
errors are in their statuses), which must count as a rank's death. Rank 2 SIGKILLs itself; each survivor
prints one line saying what ``adasum.runtime.faults.is_failure`` made of the error it got.

    mpiexec --with-ft ulfm -n 3 python tests/elastic/in_status.py
"""

import os
import signal
import time

import numpy as np
from mpi4py import MPI

from adasum.runtime import faults

comm = MPI.COMM_WORLD
if comm.Get_rank() == 2:
    os.kill(os.getpid(), signal.SIGKILL)
got, summed = np.zeros(1), np.zeros(1)
reqs = [comm.Irecv(got, source=2, tag=1), comm.Iallreduce(np.ones(1), summed)]
try:
    while not MPI.Request.Testall(reqs):
        time.sleep(0.01)
    print(f"rank {comm.Get_rank()}: no error", flush=True)
except MPI.Exception as exc:
    print(f"rank {comm.Get_rank()}: error class {exc.Get_error_class()} (ERR_IN_STATUS is {MPI.ERR_IN_STATUS}), "
          f"is_failure {faults.is_failure(exc)}", flush=True)
# What this script checks is printed. The survivors leave without MPI_Finalize: with the dead rank's
# nonblocking allreduce aborted inside Open MPI, its finalize now and then waited past the test's limit.
os._exit(0)
