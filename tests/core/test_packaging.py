"""The wheel and the sdist built from a checkout (``python -m build``): they hold the package, its kernels and
the LICENSE; the wheel installed into a fresh virtual environment runs an Adasum call under mpiexec from
outside the repository; a wheel built without a C compiler installs too and falls back to the numpy
kernels.

The fresh environments reuse the development environment's numpy and mpi4py (a path file naming a folder
that links to those two packages only, never to adasum), so nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from pathlib import Path

import numpy as np
import pytest

from adasum.kernels.native import mapped_mpi_libraries
from adasum.rule.reference import reference_allreduce

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Run on every rank of the installed package: where adasum came from, its kernels, and one call's result.
_CALL = """
import json, sys
import numpy as np
import adasum
rank = adasum.rank()
x = [np.random.default_rng(rank).standard_normal(n) for n in (5, 300)]
out = adasum.adasum_allreduce(x)
if rank == 0:
    print(json.dumps({"file": adasum.__file__, "version": adasum.__version__, "size": adasum.size(),
                      "backend": adasum.kernels_backend(), "out": [o.tolist() for o in out]}), flush=True)
"""


def _checkout_files() -> list[str]:
    """The files of this checkout a clone would have, with the ones not yet committed (not the ignored)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode()
    return [p for p in listed.split("\0") if p and (ROOT / p).is_file()]


def _build(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
    run = subprocess.run([sys.executable, "-m", "build", "--no-isolation", *args], cwd=cwd, capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, f"python -m build {' '.join(args)} failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The sdist and the wheel built from it, from a copy of the checkout; and a wheel built from the same
    sdist where the C compiler fails (CC=false)."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    for rel in _checkout_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    _build(["--outdir", str(tmp / "dist"), str(src)], cwd=tmp)  # the sdist, then the wheel from it
    (sdist,) = (tmp / "dist").glob("*.tar.gz")
    (wheel,) = (tmp / "dist").glob("*.whl")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp / "unpacked", filter="data")
    env = dict(os.environ, CC="false")
    _build(["--wheel", "--outdir", str(tmp / "nocc"), str(tmp / "unpacked" / f"adasum-{VERSION}")], cwd=tmp, env=env)
    (plain,) = (tmp / "nocc").glob("*.whl")
    return {"tmp": tmp, "sdist": sdist, "wheel": wheel, "plain": plain}


def _venv(where: Path, wheel: Path) -> Path:
    """A fresh virtual environment with ``wheel`` installed (no dependencies), seeing numpy and mpi4py of
    this environment; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    deps = where / "deps"
    deps.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for pattern in ("numpy", "numpy.libs", "numpy-*.dist-info", "mpi4py", "mpi4py-*.dist-info"):
        for entry in site.glob(pattern):
            (deps / entry.name).symlink_to(entry)
    (purelib / "_deps.pth").write_text(f"{deps}\n")
    run = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                          "--disable-pip-version-check", str(wheel)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"installing {wheel.name} failed:\n{run.stdout}\n{run.stderr}"
    return python


def _env() -> dict[str, str]:
    """This environment for the fresh one: no adasum settings, and the MPI library this process loaded
    (mpi4py looks for it next to its own environment, which the fresh one is not)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MPIEXEC_TIMEOUT="200")
    env.pop("PYTHONPATH", None)
    for name in [n for n in env if n.startswith("ADASUM_")]:
        del env[name]
    libs = {os.path.dirname(p) for p in mapped_mpi_libraries()}
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, env.get("LD_LIBRARY_PATH", "")]).strip(os.pathsep)
    return env


def _mpiexec_call(python: Path, cwd: Path, n: int = 2) -> dict:
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    assert mpiexec, "no mpiexec on PATH"
    cwd.mkdir(exist_ok=True)
    run = subprocess.run([mpiexec, "-n", str(n), str(python), "-m", "mpi4py", "-c", _CALL], cwd=cwd, env=_env(),
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    (line,) = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    return json.loads(line)


def _expected(n: int) -> list[np.ndarray]:
    return reference_allreduce([[np.random.default_rng(r).standard_normal(k) for k in (5, 300)] for r in range(n)])


def test_wheel_and_sdist_hold_the_package_and_the_license(built):
    wheel = zipfile.ZipFile(built["wheel"]).namelist()
    assert {name.split("/")[0] for name in wheel} == {"adasum", f"adasum-{VERSION}.dist-info"}, sorted(wheel)
    info = f"adasum-{VERSION}.dist-info"
    assert f"{info}/licenses/LICENSE" in wheel
    license_text = zipfile.ZipFile(built["wheel"]).read(f"{info}/licenses/LICENSE").decode()
    assert license_text == (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text
    metadata = zipfile.ZipFile(built["wheel"]).read(f"{info}/METADATA").decode()
    assert f"Version: {VERSION}" in metadata and "License-Expression: Apache-2.0" in metadata
    for req in ("numpy", "mpi4py"):
        assert any(line.startswith(f"Requires-Dist: {req}") for line in metadata.splitlines()), req
    sources = [p for p in _checkout_files() if p.startswith("adasum/") and p.endswith(".py")]
    assert sources and set(sources) <= set(wheel), sorted(set(sources) - set(wheel))
    for name in ("adasum/py.typed", "adasum/__main__.py", "adasum/envreport.py"):
        assert name in wheel
    assert any(n.startswith("adasum/kernels/_kernels.") and n.endswith(".so") for n in wheel), "no compiled kernels"
    assert not any(n.endswith(".c") for n in wheel)

    with tarfile.open(built["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for name in ("LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "setup.py", "adasum/kernels/_kernels.h",
                 "adasum/kernels/_kernels.c"):
        assert name in names, f"the sdist has no {name}"

    plain = zipfile.ZipFile(built["plain"]).namelist()
    assert not any(n.endswith(".so") for n in plain), "CC=false still compiled the kernels"
    assert f"{info}/licenses/LICENSE" in plain


def test_installed_wheel_runs_under_mpiexec_outside_the_checkout(built):
    python = _venv(built["tmp"] / "venv", built["wheel"])
    got = _mpiexec_call(python, built["tmp"] / "elsewhere")
    assert Path(got["file"]).is_relative_to(built["tmp"] / "venv"), f"adasum came from {got['file']}"
    assert not Path(got["file"]).is_relative_to(ROOT)
    assert got["version"] == VERSION and got["size"] == 2 and got["backend"] == "c"
    for o, want in zip(got["out"], _expected(2)):
        np.testing.assert_allclose(o, want, rtol=1e-12, atol=1e-12)

    report = subprocess.run([str(python), "-m", "adasum"], cwd=built["tmp"] / "elsewhere", capture_output=True,
                            text=True, timeout=200, env=_env())
    assert report.returncode == 0, report.stderr
    assert report.stdout.startswith(f"adasum {VERSION}\n")
    assert str(built["tmp"] / "venv") in report.stdout.splitlines()[1]


def test_wheel_built_without_a_compiler_runs_the_numpy_kernels(built):
    python = _venv(built["tmp"] / "venv-plain", built["plain"])
    got = _mpiexec_call(python, built["tmp"] / "elsewhere-plain")
    assert Path(got["file"]).is_relative_to(built["tmp"] / "venv-plain"), got["file"]
    assert got["backend"] == "numpy"
    for o, want in zip(got["out"], _expected(2)):
        np.testing.assert_allclose(o, want, rtol=1e-12, atol=1e-12)
