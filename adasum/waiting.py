"""How the library waits for its MPI requests.

MPI's own blocking calls poll for as long as they wait. Where a rank has one core for its compute and the
library's communication (the overlap thread during backward, one rank per core), that polling takes the
core from the compute. :func:`wait_all` polls for a short while (small messages are done by then), then
tests the requests between sleeps that grow from ``NAP_FIRST`` to at most ``NAP_MAX``, so the compute gets
the core while the bytes are on the wire; the kernel's socket buffers keep a link busy meanwhile.
"""

from __future__ import annotations

import os
import time

from mpi4py import MPI

__all__ = ["wait_all"]

SPIN = float(os.environ.get("ADASUM_WAIT_SPIN", "50e-6"))
NAP_FIRST = float(os.environ.get("ADASUM_WAIT_NAP", "20e-6"))
NAP_MAX = float(os.environ.get("ADASUM_WAIT_NAP_MAX", "500e-6"))
MODE = os.environ.get("ADASUM_WAIT", "yield")


def wait_all(reqs: list[MPI.Request]) -> None:
    """Wait until every request of ``reqs`` is complete (see the module docstring)."""
    if MODE == "spin":
        MPI.Request.Waitall(reqs)
        return
    test = MPI.Request.Testall
    if test(reqs):
        return
    clock = time.perf_counter
    until = clock() + SPIN
    while clock() < until:
        if test(reqs):
            return
    nap = NAP_FIRST
    while not test(reqs):
        time.sleep(nap)
        nap = min(2 * nap, NAP_MAX)
