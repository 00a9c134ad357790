"""Point-to-point exchanges of fused buffers, direct or staged through host memory.

The schedules hand their buffers to MPI through a :class:`Transport`, which counts them in its context's
traffic counters (:func:`adasum.count_traffic`) and waits by the one waiting rule
(:mod:`adasum.runtime.waiting`). The collectives of a call are :mod:`adasum.runtime.collectives`'s; which
buffers are staged is :mod:`adasum.runtime.gpu`'s policy; the kept buffers are reached through
:class:`~adasum.runtime.scratch.Scratch`. The agreement, the compiled small call and the stall inspector's
messages go to MPI directly (the first two counted where they are made).
"""

from __future__ import annotations

import contextlib

import numpy as np
from mpi4py import MPI

from ..adapters import Adapter
from .gpu import use_staging
from .scratch import Scratch
from .waiting import wait_all

__all__ = ["TAG", "Transport", "transport_for"]

# The tag of the library's messages (on its own duplicate communicator); scalar exchanges use TAG + 1.
TAG = 0xADA


class Transport:
    """Moves slices of flat buffers of one adapter and device between the ranks of ``comm``.

    ``staged=False`` hands MPI the buffer itself (host memory, or device memory where MPI is CUDA-aware).
    ``staged=True`` copies through host buffers kept in the call's context and reused, in chunks of the
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
        self.native = call.settings.native_mpi  # the compiled waiting rule where it is bound
        scratch = Scratch(ctx.buffers, adapter.kind, device)
        self.kept, self.stage = scratch.kept, scratch.stage  # the kept buffers (Scratch.kept, Scratch.stage)

    def _wait(self, reqs: list) -> None:
        wait_all(reqs, self.waiting, native=self.native)

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
