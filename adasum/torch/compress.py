"""16-bit wire formats for ``DistributedOptimizer(compression=...)``.

Adasum of 16-bit tensors is the library's own: it sends them as they are and computes the dot products,
norms and the combine in float32 or wider. For ``sum``/``mean`` the library widens 16-bit buffers to
float32 before ``MPI_Allreduce`` (MPI has no 16-bit float sum), so the optimizer reduces them here instead:
a reduce-scatter written as one ``Alltoall`` of 16-bit slices, each rank summing its slice in float32 in
rank order (the same bits on every rank), then one ``Allgather`` of the rounded 16-bit slices. Each rank
sends 2·(P-1)/P of the 16-bit buffer, half of what a float32 allreduce sends.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from ..context import context_for

__all__ = ["WIRE_DTYPES", "wire_dtype", "reduce_16bit"]

WIRE_DTYPES = {None: None, "none": None, "fp16": torch.float16, "float16": torch.float16,
               "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def wire_dtype(compression) -> torch.dtype | None:
    """The torch dtype that ``compression`` (None, "fp16", "bf16") sends, or None."""
    key = compression.lower() if isinstance(compression, str) else compression
    if key not in WIRE_DTYPES:
        raise ValueError(f"compression must be None, 'fp16' or 'bf16', got {compression!r}")
    return WIRE_DTYPES[key]


def reduce_16bit(tensors: list[torch.Tensor], dtype: torch.dtype, comm: MPI.Intracomm, mean: bool) -> None:
    """Sum (or mean) of ``tensors`` over ``comm``, in place, travelling as ``dtype``; identical on every rank.

    ``tensors`` may be of any float dtype and device; the result is the float32 sum of the 16-bit values
    every rank sent, rounded once to ``dtype`` and stored back in each tensor's own dtype. The messages go
    over the library's duplicate of ``comm`` and count in ``adasum.count_traffic(comm)`` as
    ``allreduce_bytes`` (the 16-bit buffer each rank contributes).
    """
    ctx = context_for(comm)
    comm = ctx.lcomm
    size = comm.Get_size()
    flat = torch.cat([t.detach().reshape(-1).to("cpu", dtype) for t in tensors]) if tensors else \
        torch.empty(0, dtype=dtype)
    n = flat.numel()
    chunk = -(-n // size)
    send = torch.zeros(chunk * size, dtype=dtype)
    send[:n] = flat
    recv = torch.empty_like(send)
    ctx.record("allreduce_bytes", n * 2)
    if chunk:
        comm.Alltoall(_raw(send), _raw(recv))
    parts = recv.view(size, chunk)
    acc = parts[0].to(torch.float32)
    for j in range(1, size):
        acc += parts[j].to(torch.float32)
    if mean:
        acc /= size
    mine = acc.to(dtype)
    out = torch.empty_like(send)
    if chunk:
        comm.Allgather(_raw(mine), _raw(out))
    off = 0
    with torch.no_grad():
        for t in tensors:
            k = t.numel()
            t.copy_(out[off:off + k].view(t.shape))
            off += k


def _raw(t: torch.Tensor):
    return [t.view(torch.int16).numpy(), MPI.SHORT]
