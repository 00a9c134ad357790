"""How the library waits for its MPI requests (the setting ``waiting``; ``"auto"`` is resolved per
communicator by :meth:`adasum.runtime.context.Context.waiting`).

MPI's blocking calls poll for as long as they wait. Where a rank has one core for its compute and its
communication (the overlap thread while backward runs, one rank per core), that polling takes the core
from the compute, and the compute takes it from the polling: both slow down. With ``"nap"`` a wait polls for
``SPIN`` seconds (a small message is done by then, as fast as a blocking call), then tests its requests
between sleeps that double from ``NAP_FIRST`` to at most ``NAP_MAX``: the compute keeps the core while the
bytes are on the wire, and the kernel's socket buffers keep a link busy between two tests (across
emulated hosts at 2.5 Gbit/s, an 8 MiB allreduce took as long napping at most 100 us as spinning; 7 %
longer with naps of up to 500 us, 38 % with 2 ms). Shared memory moves bytes only while both sides poll:
there an 8 MiB allreduce took 1.6× as long napping. ``"spin"`` is MPI's own wait.

The rule is implemented once, in the compiled kernels (``wait_rule`` in ``_kernels_mpi.c``): the agreement
and the compiled small call wait through it, and so does :func:`wait_all` wherever the kernels have bound
the MPI library (the setting ``native_mpi``, :func:`adasum.kernels.native.mpi_bound`), without the GIL.
Only an install without them waits through mpi4py, by :func:`_wait_python`, the same rule step by step.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ..kernels.native import compiled, mpi_bound
from .faults import failed, is_failure

__all__ = ["NAP_FIRST", "NAP_MAX", "SPIN", "policy", "wait_all"]

SPIN = 50e-6
NAP_FIRST = 20e-6
NAP_MAX = 100e-6


def policy(waiting: str) -> tuple[float, float, float]:
    """(spin, first nap, longest nap) in seconds for the setting ``waiting``; a longest nap of 0: spin."""
    return (SPIN, NAP_FIRST, NAP_MAX) if waiting == "nap" else (0.0, 0.0, 0.0)


def wait_all(reqs: list[MPI.Request], waiting: str, until: float | None = None, native: bool = False) -> bool:
    """Wait until every request of ``reqs`` is complete, as the setting ``waiting`` says; with ``until``
    (a ``time.monotonic()`` deadline), stop there. Returns whether they completed. ``native``: the setting
    ``native_mpi`` (wait through the compiled rule where it is bound). A rank that died makes it raise
    :class:`adasum.runtime.faults.WorldChanged`, every communicator of the library revoked."""
    try:
        return _wait_all(reqs, waiting, until, native)
    except MPI.Exception as exc:
        if is_failure(exc):
            raise failed(exc, "a collective") from exc
        raise


def _wait_all(reqs: list[MPI.Request], waiting: str, until: float | None, native: bool) -> bool:
    if until is None and waiting == "spin":
        MPI.Request.Waitall(reqs)
        return True
    if MPI.Request.Testall(reqs):
        return True
    if native and mpi_bound():
        patience = 0.0 if until is None else max(until - time.monotonic(), 1e-9)
        addresses = np.array([MPI._addressof(r) for r in reqs], dtype=np.int64)
        rc = compiled.wait_requests(addresses, patience, *policy(waiting))
        if rc > 1:
            raise MPI.Exception(rc)  # turned into WorldChanged by wait_all where it says a rank died
        return rc == 0
    return _wait_python(reqs, waiting, until)


def _wait_python(reqs: list[MPI.Request], waiting: str, until: float | None) -> bool:
    """:func:`wait_all`'s rule through mpi4py, for an install whose kernels cannot bind the MPI library."""
    test = MPI.Request.Testall
    clock = time.monotonic
    spin_until = clock() + SPIN if waiting == "nap" else float("inf")
    if until is not None:
        spin_until = min(spin_until, until)
    spins = 0
    while clock() < spin_until:
        if test(reqs):
            return True
        spins += 1
        if spins % 16 == 0:
            time.sleep(0)  # with more ranks than cores, the rank being waited for may need this core
    nap = NAP_FIRST
    while not test(reqs):
        if until is not None and clock() >= until:
            return False
        time.sleep(nap)
        nap = min(2 * nap, NAP_MAX)
    return True
