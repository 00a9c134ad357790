"""How device buffers reach MPI: directly where MPI is CUDA-aware, else staged through page-locked host
buffers (the setting ``gpu_transport``; ``cuda_aware`` overrides what the MPI library says of itself)."""

from __future__ import annotations

import ctypes
import functools
import logging

from .. import settings as _settings
from ..adapters import Adapter
from ..kernels.native import mapped_mpi_libraries

__all__ = ["cuda_aware_mpi", "get_gpu_transport", "set_gpu_transport", "use_staging"]

_log = logging.getLogger("adasum")



def set_gpu_transport(mode: str) -> None:
    """How device buffers reach MPI: ``"auto"`` (direct where MPI is CUDA-aware, staged otherwise),
    ``"direct"`` (always hand MPI the device memory) or ``"staged"`` (always copy through host buffers):
    the setting ``gpu_transport`` of :func:`adasum.configure`.

    ``"staged"`` applies to host buffers too, where it only adds a copy. The environment variable
    ``ADASUM_GPU_TRANSPORT`` sets the same at start-up. Every rank must use the same mode.
    """
    _settings.configure(gpu_transport=mode)


def get_gpu_transport() -> str:
    return _settings.current().gpu_transport


def cuda_aware_mpi() -> bool:
    """Whether the MPI library takes CUDA device memory, as it reports it (``MPIX_Query_cuda_support``).

    The setting ``cuda_aware`` (``ADASUM_CUDA_AWARE=1`` or ``=0``) overrides the query. The query's answer
    is found once and logged.
    """
    return _cuda_aware(_settings.current())


def _cuda_aware(s: _settings.Settings) -> bool:
    return _query_cuda_support() if s.cuda_aware is None else s.cuda_aware


@functools.lru_cache(maxsize=1)
def _query_cuda_support() -> bool:
    """Ask the loaded MPI library through its MPIX extension; False where it has none."""
    answer = False
    for path in [None, *mapped_mpi_libraries()]:
        try:
            lib = ctypes.CDLL(path)
            fn = getattr(lib, "MPIX_Query_cuda_support")
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        answer = bool(fn())
        break
    _log.info("adasum: MPI is %sCUDA-aware (MPIX_Query_cuda_support); device buffers go %s",
              "" if answer else "not ", "to MPI directly" if answer else "through page-locked host buffers")
    return answer


def use_staging(s: _settings.Settings, adapter: Adapter, buf) -> bool:
    """Whether exchanges of ``buf`` go through host staging buffers under the settings ``s``."""
    if s.gpu_transport == "staged":
        return True
    if adapter.is_host(buf) or s.gpu_transport == "direct":
        return False
    return not _cuda_aware(s)
