"""Was this process launched the way adasum needs: as one MPI rank among the job's processes?

adasum reduces over MPI. A job started by another launcher (torchrun, a Slurm step without MPI support, an
``mpirun`` of another MPI than the one mpi4py loaded) gives every process an MPI world of one rank: each
would "reduce" with itself alone and train alone, silently. :func:`launch_problem` reads what the
environment says about the job and names the problem; :func:`check_launch` runs it once per process, on
the first reduction and in ``DistributedOptimizer``'s constructor, and raises :class:`AdasumLaunchError`.

A plain single process (no launcher in sight, or an MPI launcher asked for one process) stays allowed: it
is how people debug. It is logged once, at INFO, on the ``"adasum"`` logger.
"""

from __future__ import annotations

import logging
import sys
from typing import Mapping, Sequence

from .. import settings as _settings

__all__ = ["AdasumLaunchError", "check_launch", "launch_problem"]

_log = logging.getLogger("adasum")


class AdasumLaunchError(RuntimeError):
    """The environment shows a job of several processes, but MPI sees this process alone."""


# MPI launchers: (who, size variable, rank variable). Where one of these is set, an MPI launcher started
# this process; if it says more than one process and MPI sees one, mpi4py loaded another MPI than the
# launcher's (or MPI could not reach the launcher).
_MPI_LAUNCHERS = (
    ("Open MPI's mpirun (or a launcher of its family: prterun, jsrun)", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_RANK"),
    ("an MPICH-style launcher (MPICH or Intel MPI mpiexec, srun --mpi=pmi2, Cray PMI)", "PMI_SIZE", "PMI_RANK"),
    ("a PMIx launcher (Open MPI 5 prterun, srun --mpi=pmix)", None, "PMIX_RANK"),
    ("MVAPICH's mpirun_rsh or mpiexec", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"),
    ("Cray PALS mpiexec", None, "PALS_RANKID"),
)
# Launchers of other frameworks: (who, size variable, rank variable, further variables worth showing).
_OTHER_LAUNCHERS = (
    ("torchrun / torch.distributed (or a launcher that sets its variables: DeepSpeed, Accelerate)",
     "WORLD_SIZE", "RANK", ("LOCAL_RANK", "LOCAL_WORLD_SIZE")),
    ("horovodrun with Gloo", "HOROVOD_SIZE", "HOROVOD_RANK", ("HOROVOD_LOCAL_RANK",)),
)
_SLURM_STEP = ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_STEP_ID")
_SLURM_JOB = ("SLURM_NTASKS", "SLURM_NPROCS")

# Every variable launch_problem looks at (what _environment copies).
VARIABLES = tuple(sorted(
    {v for _, size, rank in _MPI_LAUNCHERS for v in (size, rank) if v}
    | {v for _, size, rank, more in _OTHER_LAUNCHERS for v in (size, rank, *more)}
    | set(_SLURM_STEP) | set(_SLURM_JOB)))


def _int(env: Mapping[str, str], name: str | None) -> int | None:
    """The variable as an integer, or None where it is unset or not an integer (then it says nothing)."""
    if name is None:
        return None
    try:
        return int(env.get(name, "").strip())
    except ValueError:
        return None


def _shown(env: Mapping[str, str], names) -> str:
    return ", ".join(f"{n}={env[n].strip()}" for n in names if n and n in env)


def launch_problem(env: Mapping[str, str], world_size: int, program: str | None = None) -> str | None:
    """What is wrong with how this process was launched, or None if nothing is.

    ``env`` is the process's environment (any mapping of names to values), ``world_size`` the size of
    ``MPI.COMM_WORLD``, ``program`` the script to show in the suggested command (``"…"`` if None). Pure:
    it reads nothing else.

    With more than one MPI rank nothing is wrong. With one, a problem is an environment that shows a job of
    several processes (or a process numbered above 0 in one): an MPI launcher of another MPI than mpi4py's
    (``OMPI_COMM_WORLD_SIZE``, ``PMI_SIZE``, ``PMIX_RANK``, ``MV2_COMM_WORLD_SIZE``, ``PALS_RANKID``),
    torchrun and the launchers that mimic it (``WORLD_SIZE``, ``RANK``), horovodrun with Gloo
    (``HOROVOD_SIZE``), or Slurm when no MPI launcher started the process: a job step of several tasks
    (``SLURM_STEP_NUM_TASKS``) or, outside any step (the batch script, an ``salloc`` shell), an
    allocation of several tasks (``SLURM_NTASKS``). An MPI launcher that asked for one process
    (``mpiexec -n 1``) makes the Slurm allocation irrelevant: that one process was meant.
    """
    if world_size > 1:
        return None
    script = program or "…"
    mpi_launched, problem = _launcher_problem(env, world_size, script)
    if problem is not None or mpi_launched:
        return problem
    return _slurm_problem(env, world_size, script)


def _command(n, script: str) -> str:
    return f"mpiexec -n {n} python -m mpi4py {script}"


def _launcher_problem(env: Mapping[str, str], world_size: int, script: str) -> tuple[bool, str | None]:
    """Whether an MPI launcher started this process, and what is wrong where a launcher (an MPI's or
    another) shows a job of several processes."""
    mpi_launched = False
    for who, size_name, rank_name in _MPI_LAUNCHERS:
        size, rank = _int(env, size_name), _int(env, rank_name)
        if size is None and rank is None:
            continue
        mpi_launched = True
        if (size or 1) > 1 or (rank or 0) > 0:
            n = size if size and size > 1 else "N"
            return True, (f"MPI sees this process alone (MPI.COMM_WORLD has {world_size} rank), but it was started "
                          f"by {who} as {_job(size, rank)} ({_shown(env, (size_name, rank_name))}): the MPI "
                          f"library mpi4py loaded is not the launcher's, so every process initialised MPI on its "
                          f"own and would reduce only with itself. Launch with the mpiexec of the MPI that mpi4py "
                          f"uses (`python -m mpi4py --mpi-lib-version` names it): `{_command(n, script)}`, or "
                          f"install mpi4py against the launcher's MPI.")
    for who, size_name, rank_name, more in _OTHER_LAUNCHERS:
        size, rank = _int(env, size_name), _int(env, rank_name)
        if (size or 1) > 1 or (rank or 0) > 0:
            n = size if size and size > 1 else "N"
            return mpi_launched, (
                f"MPI sees this process alone (MPI.COMM_WORLD has {world_size} rank), but the environment "
                f"shows {_job(size, rank)} started by {who} ({_shown(env, (size_name, rank_name, *more))}): "
                f"every process would reduce only with itself. adasum communicates through MPI: start "
                f"the processes with an MPI launcher instead, `{_command(n, script)}`.")
    return mpi_launched, None


def _slurm_problem(env: Mapping[str, str], world_size: int, script: str) -> str | None:
    """What is wrong where Slurm, and no MPI launcher, shows a job of several tasks."""
    step_size, proc = _int(env, "SLURM_STEP_NUM_TASKS"), _int(env, "SLURM_PROCID")
    in_step = step_size is not None or "SLURM_STEP_ID" in env
    if in_step and ((step_size or 1) > 1 or (proc or 0) > 0):
        n = step_size if step_size and step_size > 1 else "N"
        return (f"MPI sees this process alone (MPI.COMM_WORLD has {world_size} rank), but Slurm started it "
                f"as {_job(step_size, proc)} of a job step ({_shown(env, _SLURM_STEP)}) without starting "
                f"MPI with it: every process would reduce only with itself. Launch with "
                f"`srun --mpi=pmix python -m mpi4py {script}` (or --mpi=pmi2: the plug-in your MPI "
                f"supports, `srun --mpi=list` shows them), or `{_command(n, script)}` inside the allocation.")
    tasks = next((t for t in (_int(env, name) for name in _SLURM_JOB) if t is not None), None)
    if not in_step and tasks is not None and tasks > 1:
        return (f"MPI sees this process alone (MPI.COMM_WORLD has {world_size} rank), but it runs in a "
                f"Slurm allocation of {tasks} tasks ({_shown(env, _SLURM_JOB)}) outside any job step: the "
                f"script was started without a launcher, so it would train alone. Start it with "
                f"`{_command(tasks, script)}` or `srun --mpi=pmix python -m mpi4py {script}`; "
                f"to run one process on purpose, `mpiexec -n 1 …` or `srun -n 1 …`.")
    return None


def _job(size: int | None, rank: int | None) -> str:
    if size is not None and size > 1:
        return f"process {rank} of {size}" if rank is not None else f"one of {size} processes"
    if rank is not None and rank > 0:
        return f"process {rank} of a larger job"
    return "a process of a larger job"


def _environment() -> dict[str, str]:
    """The launcher variables of this process's environment, as :mod:`adasum.settings` kept them at import."""
    env = _settings.launch_environment()
    return {name: env[name] for name in VARIABLES if name in env}


def _program(argv: Sequence[str]) -> str | None:
    """The script to show in a suggested command: ``sys.argv[0]`` where it names a Python file."""
    return argv[0] + " …" if argv and argv[0].endswith(".py") else None


def check_launch() -> None:
    """Raise :class:`AdasumLaunchError` if MPI sees this process alone in a job of several processes (see
    :func:`launch_problem`); every call while the problem stands, so no reduction runs on a wrongly launched
    process. Once it has passed (the settings keep that), later calls cost one attribute read. A plain
    single process passes and is logged once at INFO."""
    if _settings.launch_verified():
        return
    from mpi4py import MPI

    size = MPI.COMM_WORLD.Get_size()
    if size == 1:
        problem = launch_problem(_environment(), size, _program(sys.argv))
        if problem is not None:
            raise AdasumLaunchError(problem)
        _log.info("adasum: MPI.COMM_WORLD has one rank: every reduction returns its input unchanged "
                  "(for a distributed run, launch with `mpiexec -n N python -m mpi4py …`)")
    _settings.set_launch_verified()
