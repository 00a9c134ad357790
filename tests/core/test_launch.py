"""Launch detection: a job of several processes that MPI sees as worlds of one rank raises, with the launch
command, on the first reduction and in DistributedOptimizer's constructor; a plain single process runs
and says so once at INFO.

The environment logic is tested serially over many environments; the entry points in fresh processes
(every MPI rank starts one, as a foreign launcher would have started the job's processes).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import adasum
from adasum.runtime.launch import VARIABLES, launch_problem

TORCHRUN_1_OF_2 = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
ONE_OF_TWO_SLURM_TASKS = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
                          "SLURM_STEP_ID": "0"}

# (environment, what the problem must say; None: no problem)
CASES = {
    "nothing": ({}, None),
    "torchrun": (TORCHRUN_1_OF_2, ["torchrun", "process 1 of 2", "WORLD_SIZE=2, RANK=1, LOCAL_RANK=1",
                                   "`mpiexec -n 2 python -m mpi4py train.py`"]),
    "torchrun rank 0": ({"WORLD_SIZE": "4", "RANK": "0"}, ["process 0 of 4", "mpiexec -n 4"]),
    "a rank above 0 alone": ({"RANK": "3"}, ["process 3 of a larger job", "mpiexec -n N"]),
    "torch world of one": ({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}, None),
    "not a number": ({"WORLD_SIZE": "many", "RANK": ""}, None),
    "horovodrun gloo": ({"HOROVOD_SIZE": "3", "HOROVOD_RANK": "2"}, ["horovodrun", "process 2 of 3",
                                                                     "mpiexec -n 3"]),
    "open mpi launcher, other mpi": ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"},
                                     ["Open MPI's mpirun", "OMPI_COMM_WORLD_SIZE=2", "--mpi-lib-version",
                                      "mpiexec -n 2"]),
    "hydra launcher, other mpi": ({"PMI_SIZE": "3", "PMI_RANK": "0"}, ["MPICH-style", "process 0 of 3",
                                                                       "mpiexec -n 3"]),
    "pmix launcher, rank 1": ({"PMIX_RANK": "1"}, ["PMIx", "PMIX_RANK=1", "process 1 of a larger job"]),
    "pmix launcher, rank 0": ({"PMIX_RANK": "0"}, None),
    "mvapich": ({"MV2_COMM_WORLD_SIZE": "8", "MV2_COMM_WORLD_RANK": "5"}, ["MVAPICH", "process 5 of 8"]),
    "mpiexec -n 1": ({"PMI_SIZE": "1", "PMI_RANK": "0"}, None),
    "slurm step of 2 without mpi": (ONE_OF_TWO_SLURM_TASKS, ["Slurm started it as process 1 of 2 of a job step",
                                                             "SLURM_STEP_NUM_TASKS=2", "srun --mpi=pmix",
                                                             "mpiexec -n 2"]),
    "slurm step of 1 in an allocation of 4": ({"SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "4",
                                               "SLURM_PROCID": "0", "SLURM_STEP_ID": "2"}, None),
    "slurm batch script of 4 tasks": ({"SLURM_NTASKS": "4", "SLURM_NPROCS": "4", "SLURM_PROCID": "0"},
                                      ["allocation of 4 tasks", "outside any job step", "mpiexec -n 4",
                                       "mpiexec -n 1"]),
    "slurm batch script of 1 task": ({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, None),
    "mpiexec -n 1 in an allocation of 4": ({"SLURM_NTASKS": "4", "PMI_SIZE": "1", "PMI_RANK": "0"}, None),
    "srun --mpi=pmi2 with another mpi": ({**ONE_OF_TWO_SLURM_TASKS, "PMI_SIZE": "2", "PMI_RANK": "1"},
                                         ["MPICH-style", "srun --mpi=pmi2", "process 1 of 2"]),
    "torchrun inside mpiexec -n 1": ({"PMI_SIZE": "1", "PMI_RANK": "0", **TORCHRUN_1_OF_2}, ["torchrun"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_environments_of_one_mpi_rank(name):
    env, want = CASES[name]
    problem = launch_problem(env, 1, "train.py")
    if want is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith("MPI sees this process alone (MPI.COMM_WORLD has 1 rank)")
        for part in want:
            assert part in problem, (part, problem)


@pytest.mark.parametrize("name", list(CASES))
def test_several_mpi_ranks_are_never_a_problem(name):
    assert launch_problem(CASES[name][0], 2) is None
    assert launch_problem(CASES[name][0], 3, "train.py") is None


def test_without_a_program_the_command_ends_in_an_ellipsis():
    assert "`mpiexec -n 2 python -m mpi4py …`" in launch_problem(TORCHRUN_1_OF_2, 1)


def test_every_variable_the_cases_use_is_one_the_check_reads():
    assert {name for env, _ in CASES.values() for name in env} <= set(VARIABLES)


# --- through the public entry points, in fresh processes -------------------------------------------------

REDUCE_TWICE = """
import logging, sys
import numpy as np
import adasum
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(name)s %(message)s")
for attempt in range(2):
    try:
        print("result", adasum.adasum_allreduce(np.arange(3.0)).tolist())
    except adasum.AdasumLaunchError as exc:
        print("raised", type(exc).__mro__[1].__name__, exc)
"""

CONSTRUCT = """
import torch
import adasum.torch as at
try:
    at.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    print("constructed")
except RuntimeError as exc:
    print("raised", type(exc).__name__, exc)
"""


def _launched_by(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without any launcher's variables (an MPI test's own included), plus
    ``extra``: what a process started by another launcher would see."""
    prefixes = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_", "HYDI_", "MPIR_", "SLURM_", "MV2_", "PALS_")
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES and not k.startswith(prefixes)}
    env.update(extra)
    return env


def _run(code: str, extra: dict[str, str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], env=_launched_by(extra), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_a_plain_single_process_reduces_and_says_so_once_at_info():
    lines = _run(REDUCE_TWICE, {})
    assert lines.count("result [0.0, 1.0, 2.0]") == 2
    info = [line for line in lines if line.startswith("INFO adasum")]
    assert len(info) == 1 and "one rank" in info[0] and "mpiexec -n N python -m mpi4py" in info[0]


# Ranks that start the pretend-launched processes (each imports torch: at 8 ranks on 2 cores, all of them
# took 13 s a test; the first, a middle and the last of a job of 3 show the same as any larger job).
SPAWNING = 3


@pytest.mark.mpi(min_size=2)
@pytest.mark.world_size(2)
def test_a_torchrun_job_raises_on_every_process_at_every_call(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    if rank < SPAWNING:
        lines = _run(REDUCE_TWICE, {"WORLD_SIZE": str(size), "RANK": str(rank), "LOCAL_RANK": str(rank)})
        raised = [line for line in lines if line.startswith("raised")]
        assert len(raised) == 2 and not any(line.startswith(("result", "INFO")) for line in lines), lines
        assert raised[0].startswith("raised RuntimeError MPI sees this process alone")
        assert f"process {rank} of {size}" in raised[0] and f"`mpiexec -n {size} python -m mpi4py …`" in raised[0]
    # and the job's real communicator, launched by mpiexec, is untouched by any of it
    assert launch_problem({"WORLD_SIZE": str(size), "RANK": str(rank)}, comm.Get_size()) is None
    out = adasum.adasum_allreduce(np.ones(4), comm=comm)
    np.testing.assert_array_equal(out, np.ones(4))  # parallel inputs: their mean


@pytest.mark.mpi(min_size=2)
@pytest.mark.world_size(2)
def test_another_mpis_launcher_raises_in_the_optimizer_constructor(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    if rank >= SPAWNING:
        return
    lines = _run(CONSTRUCT, {"OMPI_COMM_WORLD_SIZE": str(size), "OMPI_COMM_WORLD_RANK": str(rank)})
    assert len(lines) == 1 and lines[0].startswith("raised AdasumLaunchError MPI sees this process alone"), lines
    assert f"OMPI_COMM_WORLD_SIZE={size}" in lines[0] and f"mpiexec -n {size}" in lines[0]


@pytest.mark.mpi(min_size=2)
@pytest.mark.world_size(2)
def test_a_slurm_step_without_mpi_raises_and_a_single_task_step_runs(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    if rank >= SPAWNING:
        return
    step = {"SLURM_STEP_NUM_TASKS": str(size), "SLURM_NTASKS": str(size), "SLURM_PROCID": str(rank),
            "SLURM_STEP_ID": "0"}
    lines = _run(REDUCE_TWICE, step)
    assert [line.split(" MPI sees")[0] for line in lines] == ["raised RuntimeError"] * 2, lines
    assert f"Slurm started it as process {rank} of {size} of a job step" in lines[0]
    alone = _run(CONSTRUCT, {**step, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"})
    assert alone == ["constructed"]
