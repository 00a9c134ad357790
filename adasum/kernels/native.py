"""The compiled kernels (the extension ``adasum.kernels._kernels``, built from ``adasum/kernels/_kernels*.c``: float32, float64,
float16 and bfloat16 dot products and combine, copies between tensors and buffers, the compiled small call and the agreement's
wait), where the install could build them.

``compiled`` is the extension module, or None on an install without a C compiler; the numpy kernels of
:mod:`adasum.adapters` then do the same work (``adasum.kernels_backend()`` says which is in use), and the
small calls and the agreement run through mpi4py (as they do with the setting ``native_mpi`` off).
"""

from __future__ import annotations

import ctypes
import functools
import os
import re

from mpi4py import MPI


try:
    from . import _kernels as compiled
except ImportError:  # pragma: no cover - a build without a C compiler
    compiled = None

__all__ = ["compiled", "handle", "mapped_mpi_libraries", "mpi_bound", "request", "use_isa"]

_FUNCTIONS = ("MPI_Sendrecv", "MPI_Send", "MPI_Recv", "MPI_Iallreduce", "MPI_Test")


@functools.lru_cache(maxsize=1)
def mpi_bound() -> bool:
    """Hands the compiled kernels the MPI functions of the library mpi4py loaded (found among the process's
    mapped files, never loaded anew), so that a small call and the agreement wait run without Python
    between their MPI calls. False where that is not possible (no compiled kernels, no /proc, a platform
    whose calling convention the kernels do not bind on); those then run through mpi4py, with the same
    messages and bits. Bound once per process."""
    if compiled is None or not hasattr(MPI, "_handleof"):
        return False
    for path in mapped_mpi_libraries():
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)  # only a library already loaded
            funcs = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in _FUNCTIONS]
        except (OSError, AttributeError):
            continue
        return bool(compiled.bind_mpi(*funcs))
    return False


def use_isa(cap: str) -> str:
    """Has the compiled kernels use the widest instruction set the CPU has, capped at ``cap`` (the setting
    ``kernels_isa``), and returns its name ("none" without compiled kernels). The choice is the extension's,
    process-wide; it is made again only when ``cap`` changes, and every choice gives the same bits."""
    if compiled is None:
        return "none"
    if _isa[0] != cap:
        _isa[1] = compiled.use_isa(cap)
        _isa[0] = cap
    return _isa[1]


_isa = ["auto", "none" if compiled is None else compiled.use_isa("auto")]  # (cap, instruction set) in effect


def handle(obj) -> int:
    """An MPI object's handle as a signed integer of its own width (MPICH's are 32-bit ints, Open MPI's
    pointers), as the compiled kernels take it."""
    bits = 8 * MPI._sizeof(obj)
    v = MPI._handleof(obj) & ((1 << bits) - 1)
    return v - (1 << bits) if v >> (bits - 1) else v


def request(value: int) -> MPI.Request:
    """The mpi4py request of a handle the compiled kernels left behind."""
    bits = 8 * MPI._sizeof(MPI.Request)
    return MPI.Request.fromhandle(value & ((1 << bits) - 1))


def mapped_mpi_libraries() -> list[str]:
    """Paths of the MPI libraries mapped into this process (``libmpi.so*``, the one mpi4py loaded), read
    from /proc/self/maps; empty where there is none or no /proc."""
    try:
        with open("/proc/self/maps") as maps:
            fields = [line.split(None, 5) for line in maps]
    except OSError:
        return []
    paths = dict.fromkeys(f[5].strip() for f in fields if len(f) == 6)
    return [p for p in paths if re.fullmatch(r"libmpi\.so(\.\d+)*", os.path.basename(p))]
