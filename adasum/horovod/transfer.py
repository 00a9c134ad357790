"""The data movement of :mod:`adasum.horovod`'s collectives, on a communicator whose ranks have agreed on
the call already (:mod:`.negotiate`). Reductions go through the library's allreduce (agreed and
stall-watched again there); the other collectives are one nonblocking MPI call on the library's duplicate
of the communicator, waited through the stall inspector (:func:`adasum.runtime.exchange.wait`). Tensors
travel as their bytes, so every dtype and device takes the same path (through host memory). The 16-bit
wires of ``compression`` are the calling thread's of the façade's state (:func:`.facade.wire`)."""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from ..call.allreduce import adasum_allreduce
from ..runtime import exchange
from . import facade
from .basics import Adasum, Average, MPI_OPS, Sum

__all__ = ["reduce", "reduce_group", "allgatherv", "alltoallv", "bcast", "scaled", "integral"]


def integral(tensor: torch.Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex())


def scaled(tensor: torch.Tensor, factor: float, divisor: int = 1) -> torch.Tensor:
    """``tensor`` divided by ``divisor`` and multiplied by ``factor``, in ``tensor``'s dtype: integers (and
    booleans) through float64, cast back toward zero, as Horovod scales them."""
    if integral(tensor):
        return (tensor.to(torch.float64) / divisor * factor).to(tensor.dtype)
    return tensor / divisor * factor if divisor != 1 else tensor * factor


def reduce(tensor: torch.Tensor, op: str, wire: str | None, prescale: float, postscale: float,
           comm: MPI.Intracomm) -> torch.Tensor:
    """``op`` of ``tensor`` over ``comm``, as a new tensor of ``tensor``'s dtype: as in Horovod, integer
    tensors are scaled in float64 and cast back (toward zero), and their ``Average`` is their sum divided by
    the size, cast back the same way."""
    return reduce_group([tensor], op, wire, prescale, postscale, comm)[0]


def reduce_group(tensors: list[torch.Tensor], op: str, wire: str | None, prescale: float, postscale: float,
                 comm: MPI.Intracomm) -> list[torch.Tensor]:
    """:func:`reduce` of several tensors in one call of the library's allreduce (each tensor a layer)."""
    tensors = [t.detach() for t in tensors]
    if prescale != 1.0:
        tensors = [scaled(t, prescale) for t in tensors]
    if not tensors:
        return []
    if op in MPI_OPS:
        out = [_mpi_reduce(t, op, comm) for t in tensors]
    elif wire is not None:
        out = [t.clone() for t in tensors]
        names = [f"allreduce.{i}" for i in range(len(out))]
        if op == Adasum:
            facade.wire(wire).adasum_(out, comm, names=names)
        else:
            facade.wire(wire).sum_(out, comm, mean=op == Average, names=names)
    elif op == Average and any(integral(t) for t in tensors):
        summed = adasum_allreduce(tensors, op=Sum, comm=comm)
        size = comm.Get_size()
        return [scaled(t, postscale, size) for t in summed]
    else:
        out = adasum_allreduce(tensors, op=op, comm=comm)
    return [scaled(t, postscale) for t in out] if postscale != 1.0 else list(out)


def _mpi_reduce(tensor: torch.Tensor, op: str, comm: MPI.Intracomm) -> torch.Tensor:
    """MPI's MIN, MAX or PROD of ``tensor`` over ``comm`` (16-bit floats travel as float32, booleans as
    bytes), counted as ``allreduce_bytes``."""
    wide = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.bool: torch.uint8}
    send = tensor.to("cpu", wide.get(tensor.dtype, tensor.dtype)).contiguous().numpy()
    recv = np.empty_like(send)
    with exchange.call_on(comm, f"allreduce ({op})") as call:
        req = call.lcomm.Iallreduce(send, recv, op=MPI_OPS[op])
        exchange.wait(call, req, f"allreduce ({op})", send.nbytes, field="allreduce_bytes")
    return torch.from_numpy(recv).to(tensor.device, tensor.dtype)


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """``tensor``'s bytes in host memory (a copy where it is not a contiguous CPU tensor)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, dtype=np.uint8)


def _from_bytes(raw: np.ndarray, like: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.from_numpy(raw).view(like.dtype) if raw.size else torch.empty(0, dtype=like.dtype)
    return out.reshape(rows, *like.shape[1:]).to(like.device)


def _row_bytes(tensor: torch.Tensor) -> int:
    return int(np.prod(tensor.shape[1:], dtype=np.int64)) * tensor.element_size()


def _displacements(counts: list[int]) -> list[int]:
    return [int(v) for v in np.concatenate([[0], np.cumsum(counts)[:-1]])] if counts else []


def _run(comm: MPI.Intracomm, what: str, post, nbytes: int) -> None:
    with exchange.call_on(comm, what) as call:
        exchange.wait(call, post(call.lcomm), what, nbytes)


def allgatherv(tensor: torch.Tensor, rows: list[int], comm: MPI.Intracomm) -> torch.Tensor:
    """Every rank's ``tensor`` (rank ``r`` has ``rows[r]`` rows) concatenated along dimension 0."""
    send = _bytes(tensor)
    width = _row_bytes(tensor)
    counts = [r * width for r in rows]
    recv = np.empty(sum(counts), dtype=np.uint8)
    _run(comm, "allgather",
         lambda lcomm: lcomm.Iallgatherv([send, MPI.BYTE], [recv, (counts, _displacements(counts)), MPI.BYTE]),
         send.nbytes)
    return _from_bytes(recv, tensor, sum(rows))


def alltoallv(tensor: torch.Tensor, send_rows: list[int], recv_rows: list[int],
              comm: MPI.Intracomm) -> torch.Tensor:
    """Rows ``send_rows[r]`` of ``tensor`` (in order) to rank ``r``; the rows received, in rank order."""
    width = _row_bytes(tensor)
    send = _bytes(tensor[:sum(send_rows)])
    scounts = [r * width for r in send_rows]
    rcounts = [r * width for r in recv_rows]
    recv = np.empty(sum(rcounts), dtype=np.uint8)
    _run(comm, "alltoall",
         lambda lcomm: lcomm.Ialltoallv([send, (scounts, _displacements(scounts)), MPI.BYTE],
                                        [recv, (rcounts, _displacements(rcounts)), MPI.BYTE]),
         send.nbytes)
    return _from_bytes(recv, tensor, sum(recv_rows))


def bcast(tensor: torch.Tensor, root: int, comm: MPI.Intracomm) -> torch.Tensor:
    """A new tensor holding rank ``root``'s (of ``comm``) ``tensor``."""
    out = tensor.detach().to("cpu").contiguous().clone()
    raw = out.reshape(-1).view(torch.uint8).numpy() if out.numel() else np.empty(0, dtype=np.uint8)
    exchange.bcast_buffer(comm, raw, root=root, what="broadcast")
    return out.to(tensor.device)
