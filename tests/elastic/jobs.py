"""Launching tests/elastic/worker.py as an MPI job of its own, with the ``mpiexec`` of the running Python's
environment (Open MPI in .venv-ompi, which scripts/run-elastic-tests.sh makes; MPICH in .venv)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mpi4py import MPI

WORKER = Path(__file__).with_name("worker.py")
ROOT = WORKER.parent.parent.parent
MPIEXEC = Path(sys.executable).with_name("mpiexec")
OPEN_MPI = MPI.Get_library_version().startswith("Open MPI")
LAUNCH_TIMEOUT = 240  # seconds for one job, start-up of 4-5 torch processes on a loaded 2-core machine included


def run_job(tmp_path: Path, ranks: int, *args: str, ulfm: bool = True, script: str = "worker.py",
            env: dict | None = None, slots: int | None = None) -> subprocess.CompletedProcess:
    """The worker (or another ``script`` of this folder) at ``ranks`` ranks (under Open MPI with ULFM where
    ``ulfm``), writing ``tmp_path/result.json``, with the variables ``env`` set besides; ``slots``: a host
    of that many slots and no ``--oversubscribe`` (Open MPI then starts no process beyond them); a job that
    outlives ``LAUNCH_TIMEOUT`` raises ``subprocess.TimeoutExpired``."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    room = ["--oversubscribe"] if slots is None else ["--host", f"localhost:{slots}", "--bind-to", "none"]
    how = [*room, *(["--with-ft", "ulfm"] if ulfm else [])] if OPEN_MPI else []
    out = ["--out", str(tmp_path / "result.json")] if script == WORKER.name else []
    cmd = [str(MPIEXEC), *how, "-n", str(ranks), sys.executable, str(WORKER.with_name(script)), *out, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)


def launch(tmp_path: Path, ranks: int, *args: str, **how) -> tuple[dict, list[float]]:
    """Run the worker at ``ranks`` ranks under ULFM (``how``: :func:`run_job`'s ``env`` and ``slots``); its
    result and the times the killed ranks died."""
    proc = run_job(tmp_path, ranks, *args, **how)
    out = tmp_path / "result.json"
    assert out.exists(), f"no result (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    killed = [float(p.read_text()) for p in tmp_path.glob("result.json.killed.*")]
    return json.loads(out.read_text()), killed
