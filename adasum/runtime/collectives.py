"""The collectives of a call over one transport's communicator, adapter and device: MPI's allreduce and
reduce-scatter of fused buffers, the 16-bit sums (16-bit messages, added by :mod:`adasum.rule.sum16`), the
broadcasts of slices inside a node, and the small float64 vectors of the schedules (the per-level
dot-product sums, the slice holders' partials). Every wait goes through the stall inspector
(:func:`adasum.runtime.stall.wait`), which waits by the one waiting rule (:mod:`adasum.runtime.waiting`).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from . import stall
from ..adapters.base import use_c
from ..kernels.native import compiled as _c_kernels
from ..rule.sum16 import sum_rows_16bit
from .transport import TAG, Transport

__all__ = ["Collectives"]


class Collectives:
    """The collectives of the call ``call`` over ``transport``'s communicator, adapter and device (staged
    through its host buffers where it is staged)."""

    def __init__(self, call, transport: Transport):
        self.call = call
        self.comm, self.adapter, self.device = transport.comm, transport.adapter, transport.device
        self.staged = transport.staged
        self.kept, self.stage, self.nbytes = transport.kept, transport.stage, transport.nbytes
        self._record = call.record

    def _wait(self, reqs: list, nbytes: int = 0) -> None:
        stall.wait(self.call, reqs, "exchange", nbytes, label=f"a collective of {self.call.what}")

    def allreduce_sum(self, buf) -> None:
        """``MPI_Allreduce(SUM)`` of a flat buffer, in place (MPI's own algorithm and datatypes)."""
        self._record("allreduce_bytes", self.nbytes(buf))
        self._record("collectives", 1)
        if not self.staged:
            if self.adapter.is_host(buf):
                self._wait([self.comm.Iallreduce(MPI.IN_PLACE, self.adapter.host_typed(buf), op=MPI.SUM)])
            else:
                self.adapter.synchronize(self.device)
                self._wait([self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)])
            return
        nbytes = self.nbytes(buf)
        host = self.stage(0, nbytes)
        self.adapter.to_host(buf, host)
        typed = host.view(self.adapter.numpy_dtype(buf))
        self._wait([self.comm.Iallreduce(MPI.IN_PLACE, typed, op=MPI.SUM)])
        self.adapter.from_host(host, buf)

    def allreduce_16bit(self, buf, dtype: str, mean: bool) -> None:
        """Sum (``mean``: mean) of a flat float16/bfloat16 buffer, in place, travelling as 16 bits (MPI has
        no 16-bit float sum): :meth:`reduce_scatter_16bit` in equal blocks, then every rank sends its rounded
        block to every other. Each rank sends 2·(P-1)/P of the buffer's bytes, half of a float32 allreduce's.
        (Point-to-point messages, all posted at once: MPICH's nonblocking alltoallv and allgatherv over TCP
        took twice as long as these when their waits nap.)"""
        size, me = self.comm.Get_size(), self.comm.Get_rank()
        n = self.nbytes(buf) // 2
        chunk = -(-n // size)
        counts = [max(0, min(chunk, n - j * chunk)) for j in range(size)]
        mine = self.reduce_scatter_16bit(buf, counts, dtype, size if mean else 1)
        host = self._host_bits(buf, n, 0)  # the buffer itself, or staging 0, which holds its copy already
        block = [host[j * chunk:j * chunk + counts[j]] for j in range(size)]
        block[me][...] = mine
        others = [j for j in range(size) if j != me]
        self._wait([self.comm.Irecv([block[j], MPI.UINT16_T], j, TAG) for j in others] +
                   [self.comm.Isend([block[me], MPI.UINT16_T], j, TAG) for j in others])
        if not (self.adapter.is_host(buf) and not self.staged):
            self.adapter.from_host(host.view(np.uint8), buf)

    def reduce_scatter_16bit(self, send, counts: list[int], dtype: str, divisor: int = 1) -> np.ndarray:
        """Rank j's block (``counts``) of the sum of every rank's ``send`` (a flat float16 or bfloat16
        buffer), as the host bits of ``dtype``: every rank sends block j to rank j (an alltoall of 16-bit
        blocks, as point-to-point messages posted at once), the blocks are added in float32 in rank order
        (the same bits on every rank), divided by ``divisor``, rounded once."""
        size, me = self.comm.Get_size(), self.comm.Get_rank()
        host = self._host_bits(send, sum(counts), 0, copy=True)
        mine = counts[me]
        rows = self.stage(1, 2 * mine * size).view(np.uint16).reshape(size, mine)
        lo = np.concatenate([[0], np.cumsum(counts)]).tolist()
        self._record("allreduce_bytes", 2 * sum(counts))
        others = [j for j in range(size) if j != me]
        rows[me] = host[lo[me]:lo[me + 1]]
        self._wait([self.comm.Irecv([rows[j], MPI.UINT16_T], j, TAG) for j in others] +
                   [self.comm.Isend([host[lo[j]:lo[j + 1]], MPI.UINT16_T], j, TAG) for j in others])
        if use_c(self.call.settings) and rows.flags.c_contiguous:  # one compiled pass, in cache
            out = np.empty(mine, np.uint16)
            if not _c_kernels.sum_rows16(rows, out, int(dtype == "bfloat16"), divisor):
                return out
        return sum_rows_16bit(rows, dtype, divisor)  # the rule itself (where a NaN came out: its NaN bits)

    def _host_bits(self, buf, n: int, which: int, copy: bool = False) -> np.ndarray:
        """``buf``'s ``n`` 16-bit elements as host uint16: its own memory where MPI can read it, else a
        staging buffer (``which``) that ``copy`` fills from it."""
        if self.adapter.is_host(buf) and not self.staged:
            return self.adapter.mpi_bytes(buf).view(np.uint16)
        host = self.stage(which, 2 * n).view(np.uint16)
        if copy:
            self.adapter.to_host(buf, host.view(np.uint8))
        return host

    def swap_scalars(self, vec: np.ndarray, partner: int) -> np.ndarray:
        """Swap a small host float64 vector with ``partner``."""
        out = np.empty_like(vec)
        self._record("scalar_bytes", vec.nbytes, 1)
        self._wait([self.comm.Irecv([out, MPI.DOUBLE], partner, TAG + 1),
                    self.comm.Isend([vec, MPI.DOUBLE], partner, TAG + 1)], vec.nbytes)
        return out

    def allgather_scalars(self, vec: np.ndarray) -> np.ndarray:
        """Every rank's float64 vector ``vec`` as the rows of one array."""
        vec = np.ascontiguousarray(vec, dtype=np.float64)
        rows = np.empty((self.comm.Get_size(), vec.size), dtype=np.float64)
        self._record("scalar_bytes", vec.nbytes, 1)
        self._record("collectives", 1)
        self._wait([self.comm.Iallgather([vec, MPI.DOUBLE], [rows, MPI.DOUBLE])], vec.nbytes)
        return rows

    def reduce_scatter_sum(self, send, recv, counts: list[int], dtype: str) -> None:
        """``MPI_Reduce_scatter(SUM)``: ``recv`` gets this rank's block (``counts``) of the sum of all ranks'
        ``send`` (both flat buffers of ``dtype``, which MPI must be able to add)."""
        a = self.adapter
        self._record("node_bytes", self.nbytes(send), 1)
        self._record("collectives", 1)
        if self.staged:
            hs, hr = self.stage(0, self.nbytes(send)), self.stage(1, self.nbytes(recv))
            a.to_host(send, hs)
            self._wait([self.comm.Ireduce_scatter(hs.view(np.dtype(dtype)), hr.view(np.dtype(dtype)), counts,
                                                  op=MPI.SUM)])
            a.from_host(hr, recv)
        elif a.is_host(send):
            self._wait([self.comm.Ireduce_scatter(a.host_typed(send), a.host_typed(recv), counts, op=MPI.SUM)])
        else:
            a.synchronize(self.device)
            self._wait([self.comm.Ireduce_scatter(send, recv, counts, op=MPI.SUM)])

    def broadcast_slices(self, buf, bounds: list[tuple[int, int]]) -> None:
        """Rank j broadcasts ``buf[lo:hi]`` for ``(lo, hi) = bounds[j]``, for every rank with a non-empty
        slice: afterwards every rank holds all of them. (One broadcast per rank rather than an allgather:
        over MPICH's shared memory the broadcasts took a third to a tenth of ``Allgatherv``'s time for 1-16
        MiB buffers on nodes of 2 and 3 ranks.)"""
        a = self.adapter
        me = self.comm.Get_rank()
        holders = [j for j, (lo, hi) in enumerate(bounds) if hi > lo]
        item = self.nbytes(buf[:1]) if len(buf) else 0
        self._record("node_bytes", (bounds[me][1] - bounds[me][0]) * item, len(holders))
        self._record("collectives", len(holders))
        if self.staged:
            host = self.stage(0, self.nbytes(buf))
            lo, hi = bounds[me]
            if hi > lo:  # only this rank's slice: the others arrive from their holders
                a.to_host(buf[lo:hi], host[lo * item:hi * item])
            for j in holders:
                lo, hi = bounds[j]
                self._wait([self.comm.Ibcast([host[lo * item:hi * item], MPI.BYTE], root=j)])
            a.from_host(host, buf)
            return
        if not a.is_host(buf):
            a.synchronize(self.device)
        for j in holders:
            lo, hi = bounds[j]
            self._wait([self.comm.Ibcast([a.mpi_bytes(buf[lo:hi]), MPI.BYTE], root=j)])
