"""The ops, compression choices, errors and what-is-built answers of :mod:`adasum.horovod`, and the world's
ranks and sizes."""

from __future__ import annotations

import torch
from mpi4py import MPI

from ..runtime import world
from ..runtime.stall import AdasumCollectiveError

__all__ = ["Adasum", "Average", "Sum", "Min", "Max", "Product", "Compression", "HorovodInternalError",
           "size", "rank", "local_size", "local_rank", "cross_rank", "cross_size",
           "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
           "ddl_built", "ccl_built", "cuda_built", "rocm_built"]

Adasum = "adasum"
Average = "mean"
Sum = "sum"
Min = "min"
Max = "max"
Product = "product"

MPI_OPS = {Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}
OPS = (Adasum, Average, Sum, *MPI_OPS)

#: What Horovod raises where a collective fails between the ranks. Here it is the library's
#: :class:`~adasum.AdasumCollectiveError` (a ``RuntimeError``): every mismatch between the ranks
#: (:class:`~adasum.AdasumMismatchError`, also a ``ValueError``) and every stall timeout
#: (:class:`~adasum.AdasumStallError`) is one.
HorovodInternalError = AdasumCollectiveError


class _Compressor:
    """Horovod's compressor interface: ``compress(tensor) -> (tensor, ctx)`` and
    ``decompress(tensor, ctx) -> tensor``; ``wire`` names the library's wire for the collectives."""

    wire: str | None = None
    dtype: torch.dtype | None = None

    @classmethod
    def compress(cls, tensor: torch.Tensor):
        if cls.dtype is None or not tensor.is_floating_point():
            return tensor, None
        return tensor.to(cls.dtype), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class NoneCompressor(_Compressor):
    """Full precision on the wire."""


class FP16Compressor(_Compressor):
    """Floating tensors travel as float16 (scaled by a power of two every rank agrees on, combined in
    float32: :class:`adasum.torch.window.compress.Wire`); other dtypes travel as they are."""

    wire = "fp16"
    dtype = torch.float16


class BF16Compressor(_Compressor):
    """As :class:`FP16Compressor`, with bfloat16 (this library's addition)."""

    wire = "bf16"
    dtype = torch.bfloat16


class Compression:
    """Horovod's compression choices: ``none`` and ``fp16``; ``bf16`` is this library's. Each is a class
    with ``compress`` and ``decompress``; the collectives send 16-bit values, half the bytes of float32."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def wire_of(compression) -> tuple[str | None, str | None]:
    """(the library's wire name for ``compression``, None), or (None, why it is refused)."""
    if compression is None:
        return None, None
    if isinstance(compression, type) and issubclass(compression, _Compressor):
        return compression.wire, None
    if compression in ("fp16", "bf16"):
        return compression, None
    return None, f"compression must be Compression.none, fp16 or bf16, got {compression!r}"


def size() -> int:
    return world.size()


def rank() -> int:
    return world.rank()


def local_size() -> int:
    return world.local_size()


def local_rank() -> int:
    return world.local_rank()


def cross_rank() -> int:
    """The index of this rank's node (nodes ordered by their lowest rank; a node is the ranks that share
    memory, as for :func:`local_rank`). Local after ``init()``, which finds the node layout."""
    return world.node_rank()


def cross_size() -> int:
    """The number of nodes. Local after ``init()``, which finds the node layout."""
    return world.node_count()


def mpi_built() -> bool:
    """True: every collective here runs over MPI (mpi4py)."""
    return True


def mpi_enabled() -> bool:
    """True: MPI is the only controller and transport."""
    return True


def mpi_threads_supported() -> bool:
    """Whether MPI was initialised with ``MPI_THREAD_MULTIPLE`` (needed for the asynchronous calls and
    ``overlap=True``)."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built() -> bool:
    """False: there is no Gloo controller (``adasum.torch.init_process_group`` sets up torch's own)."""
    return False


def gloo_enabled() -> bool:
    """False: there is no Gloo controller."""
    return False


def nccl_built() -> bool:
    """False: CUDA tensors are reduced over MPI, never through NCCL."""
    return False


def ddl_built() -> bool:
    """False: IBM DDL is not used."""
    return False


def ccl_built() -> bool:
    """False: oneCCL is not used."""
    return False


def cuda_built() -> bool:
    """Whether CUDA tensors can be reduced here: true where torch was built with CUDA (the library reduces
    them on the device and sends them over MPI)."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Whether torch was built for ROCm (its GPU tensors take the same path as CUDA's)."""
    return getattr(torch.version, "hip", None) is not None
