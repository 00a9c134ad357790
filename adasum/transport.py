"""Point-to-point exchanges of fused buffers, direct or staged through host memory, and traffic counting.

Every byte the library hands to MPI for point-to-point exchanges passes through :class:`Transport`, so
:func:`count_traffic` sees all of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass
from typing import Iterator

import numpy as np
from mpi4py import MPI

from .arrays import Adapter

__all__ = ["Transport", "Traffic", "count_traffic", "library_comm"]

_TAG = 0xADA


@dataclass
class Traffic:
    """Bytes and messages this rank handed to MPI while :func:`count_traffic` was active.

    ``sent_bytes`` counts the vector exchanges; ``scalar_bytes`` the per-level dot-product sums and the
    agreement check; ``allreduce_bytes`` the buffers given to ``MPI_Allreduce`` (sum, mean);
    ``node_bytes`` the buffers given to the collectives inside a node (hierarchical mode: the
    reduce-scatter's input and the slice this rank broadcasts).
    """

    sent_bytes: int = 0
    messages: int = 0
    scalar_bytes: int = 0
    allreduce_bytes: int = 0
    node_bytes: int = 0


_counters: list[Traffic] = []


@contextlib.contextmanager
def count_traffic() -> Iterator[Traffic]:
    """Count what this rank sends inside the ``with`` block::

        with adasum.count_traffic() as t:
            adasum.adasum_allreduce(grads)
        print(t.sent_bytes)
    """
    t = Traffic()
    _counters.append(t)
    try:
        yield t
    finally:
        _counters.remove(t)


def _record(field: str, nbytes: int, messages: int = 0) -> None:
    for t in _counters:
        setattr(t, field, getattr(t, field) + nbytes)
        t.messages += messages


_keyval: int | None = None


def library_comm(comm: MPI.Intracomm) -> MPI.Intracomm:
    """A duplicate of ``comm`` reserved for this library, made once (collectively) and cached on ``comm``.

    Our messages then never match a receive the application has posted on its own communicator.
    """
    global _keyval
    if comm == MPI.COMM_SELF:
        return comm
    if _keyval is None:
        _keyval = MPI.Comm.Create_keyval()
    dup = comm.Get_attr(_keyval)
    if dup is None:
        dup = comm.Dup()
        comm.Set_attr(_keyval, dup)
    return dup


class Transport:
    """Moves slices of flat buffers between ranks.

    ``staged=False`` hands MPI the buffer itself (host memory, or device memory where MPI is CUDA-aware).
    ``staged=True`` copies through host buffers that are allocated once per process and reused; the device
    is synchronised before MPI reads.
    """

    _host: dict[str, list[np.ndarray]] = {}

    def __init__(self, comm: MPI.Intracomm, adapter: Adapter, device: str, staged: bool):
        self.comm = comm
        self.adapter = adapter
        self.device = device
        self.staged = staged

    def _stage(self, which: int, nbytes: int) -> np.ndarray:
        pool = self._host.setdefault(f"{self.adapter.kind}:{self.device}", [None, None])
        buf = pool[which]
        if buf is None or buf.nbytes < nbytes:
            buf = pool[which] = self.adapter.host_bytes_empty(max(nbytes, 1 << 16), self.device)
        return buf[:nbytes]

    def _nbytes(self, buf) -> int:
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
            packed = self._stage(0, sum(p.nbytes for p in live))
            np.concatenate([p.reshape(-1).view(np.uint8) for p in live], out=packed)
            return [packed, MPI.BYTE], None
        dtype = MPI.BYTE.Create_hindexed([p.nbytes for p in live], [MPI.Get_address(p) for p in live])
        dtype.Commit()
        return [MPI.BOTTOM, 1, dtype], dtype

    def sendrecv(self, send, dest: int, recv, source: int) -> None:
        if type(send) is np.ndarray and type(recv) is np.ndarray and not self.staged:
            _record("sent_bytes", send.nbytes, 1)
            self.comm.Sendrecv([send, MPI.BYTE], dest, _TAG, [recv, MPI.BYTE], source, _TAG)
            return
        sbytes, rbytes = self._nbytes(send), self._nbytes(recv)
        _record("sent_bytes", sbytes, 1)
        if not self.staged:
            with self._described(send, True) as smsg, self._described(recv, False) as rmsg:
                self.comm.Sendrecv(smsg, dest, _TAG, rmsg, source, _TAG)
            return
        hs, hr = self._stage(0, sbytes), self._stage(1, rbytes)
        self.adapter.to_host(send, hs)
        self.comm.Sendrecv([hs, MPI.BYTE], dest, _TAG, [hr, MPI.BYTE], source, _TAG)
        self.adapter.from_host(hr, recv)

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
                reqs.append(self.comm.Irecv(msg, source, _TAG))
            packed = sum(sum(p.nbytes for p in b) for b in sends if type(b) is list and len(b) > 1)
            stage, at = (self._stage(0, packed) if packed else None), 0
            for buf in sends:
                if type(buf) is list:
                    live = [p.reshape(-1).view(np.uint8) for p in buf if p.nbytes]
                    if len(live) > 1:
                        n = sum(p.nbytes for p in live)
                        np.concatenate(live, out=stage[at:at + n])
                        buf, at = stage[at:at + n], at + n
                    else:
                        buf = live[0] if live else np.empty(0, np.uint8)
                _record("sent_bytes", buf.nbytes, 1)
                reqs.append(self.comm.Isend([buf, MPI.BYTE], dest, _TAG))
            MPI.Request.Waitall(reqs)
        finally:
            for dtype in dtypes:
                dtype.Free()

    def allreduce_sum(self, buf) -> None:
        """``MPI_Allreduce(SUM)`` of a flat buffer, in place (MPI's own algorithm and datatypes)."""
        _record("allreduce_bytes", self._nbytes(buf))
        if not self.staged:
            if self.adapter.is_host(buf):
                self.comm.Allreduce(MPI.IN_PLACE, self.adapter.host_typed(buf), op=MPI.SUM)
            else:
                self.adapter.synchronize(self.device)
                self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            return
        nbytes = self._nbytes(buf)
        host = self._stage(0, nbytes)
        self.adapter.to_host(buf, host)
        typed = host.view(self.adapter.numpy_dtype(buf))
        self.comm.Allreduce(MPI.IN_PLACE, typed, op=MPI.SUM)
        self.adapter.from_host(host, buf)

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
        nbytes = self._nbytes(buf)
        _record("sent_bytes", nbytes, 1)
        if not self.staged:
            with self._described(buf, True) as msg:
                self.comm.Send(msg, dest, _TAG)
            return
        hs = self._stage(0, nbytes)
        self.adapter.to_host(buf, hs)
        self.comm.Send([hs, MPI.BYTE], dest, _TAG)

    def recv(self, buf, source: int) -> None:
        if not self.staged:
            with self._described(buf, False) as msg:
                self.comm.Recv(msg, source, _TAG)
            return
        hr = self._stage(1, self._nbytes(buf))
        self.comm.Recv([hr, MPI.BYTE], source, _TAG)
        self.adapter.from_host(hr, buf)


def scalar_sendrecv(comm: MPI.Intracomm, vec: np.ndarray, partner: int) -> np.ndarray:
    """Swap a small host float64 vector with ``partner``."""
    out = np.empty_like(vec)
    _record("scalar_bytes", vec.nbytes, 1)
    comm.Sendrecv([vec, MPI.DOUBLE], partner, _TAG + 1, [out, MPI.DOUBLE], partner, _TAG + 1)
    return out


# --- device buffers: CUDA-aware MPI or host staging ------------------------------------------------------

_MODES = ("auto", "direct", "staged")
_mode = os.environ.get("ADASUM_GPU_TRANSPORT", "auto").strip().lower() or "auto"
_cuda_aware: bool | None = None
_log = logging.getLogger("adasum")


def set_gpu_transport(mode: str) -> None:
    """How device buffers reach MPI: ``"auto"`` (direct where MPI is CUDA-aware, staged otherwise),
    ``"direct"`` (always hand MPI the device memory) or ``"staged"`` (always copy through host buffers).

    ``"staged"`` applies to host buffers too, where it only adds a copy. The environment variable
    ``ADASUM_GPU_TRANSPORT`` sets the same at start-up. Every rank must use the same mode.
    """
    global _mode
    if mode not in _MODES:
        raise ValueError(f"gpu transport must be one of {_MODES}, got {mode!r}")
    _mode = mode


def get_gpu_transport() -> str:
    return _mode


def cuda_aware_mpi() -> bool:
    """Whether the MPI library takes CUDA device memory, as it reports it (``MPIX_Query_cuda_support``).

    ``ADASUM_CUDA_AWARE=1`` or ``=0`` overrides the query. The answer is found once and logged.
    """
    global _cuda_aware
    if _cuda_aware is None:
        env = os.environ.get("ADASUM_CUDA_AWARE")
        if env is not None and env.strip() != "":
            _cuda_aware, how = env.strip().lower() in ("1", "true", "yes", "on"), "ADASUM_CUDA_AWARE"
        else:
            _cuda_aware, how = _query_cuda_support(), "MPIX_Query_cuda_support"
        _log.info("adasum: MPI is %sCUDA-aware (%s); device buffers go %s",
                  "" if _cuda_aware else "not ", how, "to MPI directly" if _cuda_aware else
                  "through page-locked host buffers")
    return _cuda_aware


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


def _query_cuda_support() -> bool:
    """Ask the loaded MPI library through its MPIX extension; False where it has none."""
    import ctypes

    for path in [None, *mapped_mpi_libraries()]:
        try:
            lib = ctypes.CDLL(path)
            fn = getattr(lib, "MPIX_Query_cuda_support")
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return bool(fn())
    return False


def use_staging(adapter: Adapter, buf) -> bool:
    """Whether exchanges of ``buf`` go through host staging buffers under the current mode."""
    if _mode == "staged":
        return True
    if adapter.is_host(buf) or _mode == "direct":
        return False
    return not cuda_aware_mpi()
