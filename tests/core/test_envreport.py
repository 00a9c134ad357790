"""``python -m adasum``: the environment report prints what a bug report needs and exits 0, with torch or
without it, alone or under mpiexec (rank 0 printing)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import adasum
from adasum import envreport

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _run(args: list[str], timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, OMP_NUM_THREADS="1", **env)
    return subprocess.run(args, cwd=ROOT.parent, env=environ, capture_output=True, text=True, timeout=timeout)


def _field(out: str, name: str) -> str:
    """The value on the report's line ``  name   value``."""
    m = re.search(rf"^  {re.escape(name)}\s+(.*)$", out, flags=re.M)
    assert m, f"no line {name!r} in the report:\n{out}"
    return m[1]


def test_version_is_the_projects():
    assert adasum.__version__ == VERSION


@pytest.mark.timeout(200)
def test_python_m_adasum_reports_and_exits_0():
    run = _run([sys.executable, "-m", "adasum"])
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.startswith(f"adasum {VERSION}\n"), out
    assert _field(out, "location").startswith(os.path.dirname(adasum.__file__))
    assert out.splitlines()[2].startswith(f"Python {sys.version.split()[0]} "), out
    import mpi4py
    import numpy

    assert _field(out, "numpy") == numpy.__version__
    assert _field(out, "mpi4py") == mpi4py.__version__
    for name in ("torch", "cupy", "lightning", "accelerate", "transformers"):
        _field(out, name)  # a version or "not installed"
    from mpi4py import MPI

    library = " ".join(MPI.Get_library_version().splitlines()[0].split())
    assert _field(out, "library") == library
    assert _field(out, "standard") == "MPI {}.{}".format(*MPI.Get_version())
    ulfm = _field(out, "ULFM")
    assert ulfm.startswith("available in the library: ")
    assert re.search(r"^\s+enabled in this job: (yes|no)", out, flags=re.M), out
    if library.startswith("MPICH"):
        assert ulfm.startswith("available in the library: no"), ulfm
        assert "enabled in this job: no" in out
    assert _field(out, "CUDA-aware").split()[0] in ("yes", "no")
    assert _field(out, "back end") == adasum.kernels_backend()
    from adasum.kernels.native import compiled

    isa = _field(out, "instruction set")
    assert (isa == "none") == (compiled is None), isa
    assert _field(out, "world").startswith("1 rank")
    assert _field(out, "CPUs").startswith(str(os.cpu_count()))
    assert _field(out, "OMP_NUM_THREADS") == "1"


@pytest.mark.timeout(200)
def test_report_without_torch():
    """torch blocked (an entry of None in sys.modules makes its import fail, as if it were not installed):
    the report still runs to the end and says so. A setting from the environment shows, and takes effect."""
    code = ("import runpy, sys; sys.modules['torch'] = None; "
            "runpy.run_module('adasum', run_name='__main__', alter_sys=True)")
    run = _run([sys.executable, "-c", code], ADASUM_KERNELS="numpy")
    assert run.returncode == 0, run.stderr
    assert _field(run.stdout, "torch") == "not installed"
    assert "torch threads" not in run.stdout
    assert "torch" not in run.stderr
    assert _field(run.stdout, "back end") == "numpy"
    assert "ADASUM_KERNELS=numpy" in _field(run.stdout, "settings")
    assert run.stdout.rstrip().endswith(_field(run.stdout, "OMP_NUM_THREADS")), "the report stopped early"


def test_a_missing_package_is_not_installed():
    assert envreport.package_version("adasum_no_such_package") == "not installed"
    assert envreport.package_version("numpy") != "not installed"


@pytest.mark.timeout(240)
def test_under_mpiexec_rank_0_prints_the_job():
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    assert mpiexec, "no mpiexec on PATH"
    run = _run([mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "adasum"], timeout=220,
               MPIEXEC_TIMEOUT="200")
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    assert run.stdout.count(f"adasum {VERSION}\n") == 1, f"want one report (rank 0's), got:\n{run.stdout}"
    assert run.stdout.count("\nkernels\n") == 1
    assert _field(run.stdout, "world") == "2 ranks on 1 host"
