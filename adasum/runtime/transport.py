"""Point-to-point exchanges and collectives of fused buffers, direct or staged through host memory.

The schedules hand their buffers to MPI through a :class:`Transport`, which counts them in its context's
traffic counters (:func:`adasum.count_traffic`). The agreement, the compiled small call and the stall
inspector's messages go to MPI directly (the first two counted where they are made).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging


import numpy as np
from mpi4py import MPI

from . import settings as _settings
from ..adapters import Adapter
from ..kernels.native import mapped_mpi_libraries
from .waiting import wait_all

__all__ = ["TAG", "Transport", "cuda_aware_mpi", "get_gpu_transport", "set_gpu_transport", "transport_for",
           "use_staging"]

# The tag of the library's messages (on its own duplicate communicator); scalar exchanges use TAG + 1.
TAG = 0xADA
_log = logging.getLogger("adasum")


class Transport:
    """Moves slices of flat buffers of one adapter and device between the ranks of ``comm``.

    ``staged=False`` hands MPI the buffer itself (host memory, or device memory where MPI is CUDA-aware).
    ``staged=True`` copies through host buffers kept in the context ``ctx`` and reused, in chunks of the
    setting ``chunk_bytes`` (0: one chunk) on the adapter's side stream (:class:`adasum.adapters.CopyStream`):
    chunk i is sent as soon as its copy to the host is done while the next ones are copied, and each chunk
    received is copied to the device while the next arrives. Each chunk is a message of its own; both sides
    cut alike, since ``chunk_bytes`` is agreed.
    """

    def __init__(self, call, comm: MPI.Intracomm, adapter: Adapter, device: str, staged: bool):
        ctx = self.ctx = call.ctx  # what outlives the call: its buffers, its counters
        self.chunk_bytes = call.settings.chunk_bytes  # agreed: both sides cut their messages alike
        self.comm = comm
        self.adapter = adapter
        self.device = device
        self.staged = staged
        self._record = ctx.record
        self.waiting = call.waiting  # "nap" or "spin" (adasum.runtime.waiting)

    def _wait(self, reqs: list) -> None:
        wait_all(reqs, self.waiting)

    def kept(self, dtype: str, n: int, slot: str = "recv"):
        """``n`` elements of a buffer of this transport's kind and device, kept in the context between calls."""
        return self.ctx.buffers.get(self.adapter.kind, self.device, dtype, n, slot)

    def stage(self, which: int, nbytes: int) -> np.ndarray:
        """Host bytes kept for staged transfers (``which``: 0 for what is sent, 1 for what is received)."""
        return self.ctx.buffers.staging(self.adapter.kind, self.device, which, nbytes)

    def nbytes(self, buf) -> int:
        if type(buf) is np.ndarray:
            return buf.nbytes
        if type(buf) is list:
            return sum(int(p.nbytes) for p in buf)
        return int(buf.numel() * buf.element_size()) if hasattr(buf, "element_size") else int(buf.nbytes)

    def _message(self, buf, sending: bool):
        """mpi4py's message for ``buf`` and a datatype to free after the call (or None).

        ``buf`` may be a list of flat host arrays (pieces of the caller's tensors). Received, they are
        described to MPI by an hindexed datatype over their addresses and written where they lie. Sent,
        they are first packed into a host buffer: MPI's fast paths for large messages read contiguous
        memory only (an hindexed send runs several times slower).
        """
        if type(buf) is np.ndarray:
            return [buf, MPI.BYTE], None  # mpi4py counts the bytes of the buffer
        if type(buf) is not list:
            if not self.adapter.is_host(buf):
                self.adapter.synchronize(self.device)
            return [self.adapter.mpi_bytes(buf), MPI.BYTE], None
        live = [p for p in buf if p.nbytes]
        if len(live) <= 1:
            return [live[0].reshape(-1).view(np.uint8) if live else np.empty(0, np.uint8), MPI.BYTE], None
        if sending:
            packed = self.stage(0, sum(p.nbytes for p in live))
            np.concatenate([p.reshape(-1).view(np.uint8) for p in live], out=packed)
            return [packed, MPI.BYTE], None
        dtype = MPI.BYTE.Create_hindexed([p.nbytes for p in live], [MPI.Get_address(p) for p in live])
        dtype.Commit()
        return [MPI.BOTTOM, 1, dtype], dtype

    def sendrecv(self, send, dest: int, recv, source: int) -> None:
        if type(send) is np.ndarray and type(recv) is np.ndarray and not self.staged:
            self._record("sent_bytes", send.nbytes, 1)
            self._wait([self.comm.Irecv([recv, MPI.BYTE], source, TAG),
                        self.comm.Isend([send, MPI.BYTE], dest, TAG)])
            return
        sbytes, rbytes = self.nbytes(send), self.nbytes(recv)
        self._record("sent_bytes", sbytes, 1)
        if not self.staged:
            with self._described(send, True) as smsg, self._described(recv, False) as rmsg:
                self._wait([self.comm.Irecv(rmsg, source, TAG), self.comm.Isend(smsg, dest, TAG)])
            return
        self._staged(send, sbytes, dest, recv, rbytes, source)

    def _staged(self, send, sbytes: int, dest: int, recv, rbytes: int, source: int) -> None:
        """Send ``send`` (``sbytes``; None: nothing) to ``dest`` and receive ``recv`` (``rbytes``; None:
        nothing) from ``source`` through the staging buffers, chunk by chunk (see the class docstring)."""
        a = self.adapter
        step = self.chunk_bytes
        copies = a.copy_stream(self.device)
        rcuts = _byte_chunks(rbytes, step) if recv is not None else []
        scuts = _byte_chunks(sbytes, step) if send is not None else []
        hr = self.stage(1, rbytes) if recv is not None else None
        rreqs = [self.comm.Irecv([hr[lo:hi], MPI.BYTE], source, TAG) for lo, hi in rcuts]
        sreqs = []
        copies.begin()
        if send is not None:
            hs, sbuf = self.stage(0, sbytes), a.byte_view(send)
            marks = [copies.to_host(sbuf[lo:hi], hs[lo:hi]) for lo, hi in scuts]
            for (lo, hi), mark in zip(scuts, marks):
                copies.wait(mark)
                sreqs.append(self.comm.Isend([hs[lo:hi], MPI.BYTE], dest, TAG))
            if len(scuts) > 1:
                self._record("sent_bytes", 0, len(scuts) - 1)  # the bytes are counted by the caller
        if recv is not None:
            rbuf = a.byte_view(recv)
            for (lo, hi), req in zip(rcuts, rreqs):
                self._wait([req])
                copies.from_host(hr[lo:hi], rbuf[lo:hi])
        self._wait(sreqs)
        copies.end()

    def exchange(self, sends: list, dest: int, recvs: list, source: int) -> None:
        """Send each of ``sends`` to ``dest`` and receive each of ``recvs`` from ``source``, as separate
        messages in list order, message i both ways at once (full duplex); uneven lists finish one way.
        Items are buffers or lists of flat host pieces, as in :meth:`sendrecv`. Several messages are all
        posted at once, so that their hand-shakes overlap."""
        if (len(sends) > 1 or len(recvs) > 1) and not self.staged:
            sends, recvs = [self._host_array(b) for b in sends], [self._host_array(b) for b in recvs]
            if all(type(b) in (np.ndarray, list) for b in (*sends, *recvs)):
                self._post_all(sends, dest, recvs, source)
                return
        for i in range(max(len(sends), len(recvs))):
            if i < len(sends) and i < len(recvs):
                self.sendrecv(sends[i], dest, recvs[i], source)
            elif i < len(sends):
                self.send(sends[i], dest)
            else:
                self.recv(recvs[i], source)

    def _host_array(self, buf):
        """``buf`` as a numpy array where it is a host tensor of another kind (a torch CPU tensor: the
        bytes of its own memory), so that :meth:`_post_all` can take it; anything else as it is."""
        if type(buf) in (np.ndarray, list) or not self.adapter.is_host(buf):
            return buf
        return self.adapter.mpi_bytes(buf)

    def _post_all(self, sends: list, dest: int, recvs: list, source: int) -> None:
        """:meth:`exchange` of host messages as nonblocking requests: the receives first, then the sends
        (lists of pieces packed side by side into one staging buffer), then one wait for all."""
        dtypes, reqs = [], []
        try:
            for buf in recvs:
                msg, dtype = self._message(buf, sending=False)
                if dtype is not None:
                    dtypes.append(dtype)
                reqs.append(self.comm.Irecv(msg, source, TAG))
            packed = sum(sum(p.nbytes for p in b) for b in sends if type(b) is list and len(b) > 1)
            stage, at = (self.stage(0, packed) if packed else None), 0
            for buf in sends:
                if type(buf) is list:
                    live = [p.reshape(-1).view(np.uint8) for p in buf if p.nbytes]
                    if len(live) > 1:
                        n = sum(p.nbytes for p in live)
                        np.concatenate(live, out=stage[at:at + n])
                        buf, at = stage[at:at + n], at + n
                    else:
                        buf = live[0] if live else np.empty(0, np.uint8)
                self._record("sent_bytes", buf.nbytes, 1)
                reqs.append(self.comm.Isend([buf, MPI.BYTE], dest, TAG))
            self._wait(reqs)
        finally:
            for dtype in dtypes:
                dtype.Free()

    def allreduce_sum(self, buf) -> None:
        """``MPI_Allreduce(SUM)`` of a flat buffer, in place (MPI's own algorithm and datatypes)."""
        self._record("allreduce_bytes", self.nbytes(buf))
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
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN carry on, as in a float sum
            acc = widen_16bit(rows[0], dtype)
            for j in range(1, size):
                acc += widen_16bit(rows[j], dtype)
            if divisor != 1:
                acc /= np.float32(divisor)
            return narrow_16bit(acc, dtype)

    def _host_bits(self, buf, n: int, which: int, copy: bool = False) -> np.ndarray:
        """``buf``'s ``n`` 16-bit elements as host uint16: its own memory where MPI can read it, else a
        staging buffer (``which``) that ``copy`` fills from it."""
        if self.adapter.is_host(buf) and not self.staged:
            return self.adapter.mpi_bytes(buf).view(np.uint16)
        host = self.stage(which, 2 * n).view(np.uint16)
        if copy:
            self.adapter.to_host(buf, host.view(np.uint8))
        return host

    @contextlib.contextmanager
    def _described(self, buf, sending: bool):
        """:meth:`_message` for one MPI call, its datatype freed afterwards."""
        msg, dtype = self._message(buf, sending)
        try:
            yield msg
        finally:
            if dtype is not None:
                dtype.Free()

    def send(self, buf, dest: int) -> None:
        nbytes = self.nbytes(buf)
        self._record("sent_bytes", nbytes, 1)
        if not self.staged:
            with self._described(buf, True) as msg:
                self._wait([self.comm.Isend(msg, dest, TAG)])
            return
        self._staged(buf, nbytes, dest, None, 0, dest)

    def recv(self, buf, source: int) -> None:
        if not self.staged:
            with self._described(buf, False) as msg:
                self._wait([self.comm.Irecv(msg, source, TAG)])
            return
        self._staged(None, 0, source, buf, self.nbytes(buf), source)


    def swap_scalars(self, vec: np.ndarray, partner: int) -> np.ndarray:
        """Swap a small host float64 vector with ``partner``."""
        out = np.empty_like(vec)
        self._record("scalar_bytes", vec.nbytes, 1)
        self.comm.Sendrecv([vec, MPI.DOUBLE], partner, TAG + 1, [out, MPI.DOUBLE], partner, TAG + 1)
        return out

    def allgather_scalars(self, vec: np.ndarray) -> np.ndarray:
        """Every rank's float64 vector ``vec`` as the rows of one array."""
        vec = np.ascontiguousarray(vec, dtype=np.float64)
        rows = np.empty((self.comm.Get_size(), vec.size), dtype=np.float64)
        self._record("scalar_bytes", vec.nbytes, 1)
        self.comm.Allgather([vec, MPI.DOUBLE], [rows, MPI.DOUBLE])
        return rows

    def reduce_scatter_sum(self, send, recv, counts: list[int], dtype: str) -> None:
        """``MPI_Reduce_scatter(SUM)``: ``recv`` gets this rank's block (``counts``) of the sum of all ranks'
        ``send`` (both flat buffers of ``dtype``, which MPI must be able to add)."""
        a = self.adapter
        self._record("node_bytes", self.nbytes(send), 1)
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


def widen_16bit(bits: np.ndarray, dtype: str) -> np.ndarray:
    """float16 or bfloat16 values, given as their uint16 bits, as a new float32 array (exact)."""
    if dtype == "float16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def narrow_16bit(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``values`` rounded to the nearest float16 or bfloat16 (ties to even; NaN stays NaN), as
    uint16 bits: the rounding of torch's and numpy's casts."""
    if dtype == "float16":
        return values.astype(np.float16).view(np.uint16)
    u = values.view(np.uint32)
    r = u >> 16  # in place from here: half the time of the same arithmetic on temporaries
    r &= 1
    r += u
    r += 0x7FFF
    r >>= 16
    bits = r.astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        bits[nan] = 0x7FC0
    return bits


def transport_for(call, comm: MPI.Intracomm, adapter: Adapter, device: str, buf) -> Transport:
    """The transport of ``buf`` (None: the caller's host tensors) on ``comm``, under the settings of
    ``call``: staged or direct (:func:`use_staging`), cut at its ``chunk_bytes``."""
    staged = buf is not None and use_staging(call.settings, adapter, buf)
    return Transport(call, comm, adapter, device, staged=staged)


def _byte_chunks(nbytes: int, step: int) -> list[tuple[int, int]]:
    """``[0, nbytes)`` cut into chunks of ``step`` bytes (the last shorter; one chunk for ``step`` 0)."""
    if not step or nbytes <= step:
        return [(0, nbytes)]
    return [(lo, min(lo + step, nbytes)) for lo in range(0, nbytes, step)]


# --- device buffers: CUDA-aware MPI or host staging ------------------------------------------------------


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
