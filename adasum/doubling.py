"""Adasum by recursive doubling of whole vectors: the schedule for small messages.

At level l (l = 1 … k) rank v swaps its whole current vector with v XOR 2^(l-1) and both combine the pair
locally, the lower subtree's vector on the left (SPEC §3 pairs the same ranks as :mod:`adasum.vhdd`). Each
rank sends log2(P)·N bytes instead of about 2·N, but makes k message rounds instead of 2k plus the
per-level dot-product sums, which is what counts when N is small: there the cost of a call is its rounds.

Both partners compute the same coefficients from the same two vectors with the same kernel and operand
order, so they hold bitwise the same result after every level and every rank ends with the same bits.
P = 2^k + r folds the first r adjacent pairs exactly as :mod:`adasum.vhdd` does.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Sequence

import numpy as np
from mpi4py import MPI

from .arrays import _nonempty
from .fusion import Group, layer_spans, pool_generation, pooled
from . import transport as _transport
from .transport import _TAG, Transport
from .validate import AGREE_BYTES
from .vhdd import fold_out

try:
    from . import _kernels
except ImportError:  # pragma: no cover - a build without a C compiler (SmallCall is then never made)
    _kernels = None

__all__ = ["adasum_reduce_doubling"]


def _combine_pair(groups, spans, scratches, count_left: int, count_right: int, upper: bool, last: bool) -> None:
    """``Adasum(left, right)`` into the buffer (or, at the ``last`` level, where the result goes), where this
    rank's buffer holds the right vector if ``upper``."""
    for g, (layers, sp, sp_array), scr in zip(groups, spans, scratches):
        if not sp:
            continue
        left, right = (scr, g.buffer) if upper else (g.buffer, scr)
        # Both partners make the same call (left first), so they hold the same bits.
        dst = (g.buffer if not g.writes_parts else _nonempty(g.parts, layers)) if last else g.buffer
        g.adapter.pair(left, right, dst, sp, sp_array, count_left, count_right)


@functools.lru_cache(maxsize=256)
def schedule(size: int, rank: int, counts: tuple[int, ...] | None = None):
    """What ``rank`` does, as plain numbers: ``("out", partner)`` for a folded-out rank (SPEC §3), else
    ``(fold, levels)`` with ``fold = (partner, count_self, count_partner)`` or None and one
    ``(partner, count_left, count_right, upper)`` per level of the tree."""
    counts = counts if counts is not None else (1,) * size
    k = size.bit_length() - 1
    extra = size - (1 << k)

    def real(u: int) -> int:
        return 2 * u if u < extra else u + extra

    if rank < 2 * extra and rank % 2 == 1:
        return "out", rank - 1
    fold = (rank + 1, counts[rank], counts[rank + 1]) if rank < 2 * extra else None
    v = rank // 2 if rank < 2 * extra else rank - extra
    vcounts = [counts[2 * u] + counts[2 * u + 1] if u < extra else counts[u + extra] for u in range(1 << k)]
    levels = []
    for level in range(1, k + 1):
        d = 1 << (level - 1)
        base = (v >> level) << level
        levels.append((real(v ^ d), sum(vcounts[base:base + d]), sum(vcounts[base + d:base + 2 * d]), bool(v & d)))
    return fold, tuple(levels)


def adasum_reduce_doubling(comm: MPI.Intracomm, groups: Sequence[Group], transports: Sequence[Transport], *,
                           counts: Sequence[int] | None = None) -> None:
    """Replace every group's buffer, in place and on every rank, by the Adasum of all ranks' buffers.

    ``counts[r]``: how many ranks rank r's vector stands for (1 each for plain Adasum). The buffers must
    be packed; a group that ``writes_parts`` gets its result written into the caller's tensors.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or not groups:
        return
    plan = schedule(size, rank, None if counts is None else tuple(counts))
    if plan[0] == "out":
        fold_out(groups, transports, rank, size - (1 << (size.bit_length() - 1)))
        return
    fold, levels = plan
    spans = [layer_spans(g) for g in groups]
    scratches = [pooled(g, g.size, "recv") for g in groups]
    if fold is not None:
        for t, scr in zip(transports, scratches):
            t.recv(scr, fold[0])
        _combine_pair(groups, spans, scratches, fold[1], fold[2], upper=False, last=False)
    for i, (partner, count_left, count_right, upper) in enumerate(levels):
        for g, t, scr in zip(groups, transports, scratches):
            t.sendrecv(g.buffer, partner, scr, partner)
        _combine_pair(groups, spans, scratches, count_left, count_right, upper, last=i == len(levels) - 1)
    if fold is not None:
        for g, t, (layers, _, _) in zip(groups, transports, spans):
            t.send(g.buffer if not g.writes_parts else _nonempty(g.parts, layers), fold[0])


def _bind_native_mpi() -> bool:
    """Hands ``_kernels.small_doubling`` the MPI functions of the library mpi4py loaded (found among the
    process's mapped files, never loaded anew), so that a small call runs without Python between its MPI
    calls and kernels. False where that is not possible (no compiled kernels, no /proc, a platform whose
    calling convention the kernels do not bind on) or where ``ADASUM_NATIVE_MPI=0`` turns it off; small
    calls then go through :class:`SmallCall` in Python, with the same messages and bits."""
    if _kernels is None or not hasattr(MPI, "_handleof"):
        return False
    if os.environ.get("ADASUM_NATIVE_MPI", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    for path in _transport.mapped_mpi_libraries():
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)  # only a library already loaded
            funcs = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                     for name in ("MPI_Allreduce", "MPI_Sendrecv", "MPI_Send", "MPI_Recv")]
        except (OSError, AttributeError):
            continue
        return bool(_kernels.bind_mpi(*funcs))
    return False


_native: bool | None = None  # bound yet? None: not tried


def native_enabled() -> bool:
    """Whether small calls on numpy arrays and torch CPU tensors run in one compiled call (see
    :func:`_bind_native_mpi`)."""
    global _native
    if _native is None:
        _native = _bind_native_mpi()
    return _native


def set_native(enabled: bool) -> None:
    """Turn the compiled small-call path on (where it can be bound) or off; both give the same bits."""
    global _native
    _native = _bind_native_mpi() if enabled else False


class SmallCall:
    """:func:`adasum_reduce_doubling` of one plan's single host group (float32/float64, compiled kernels)
    on one communicator, with all that stays the same between calls worked out once: the schedule, the
    transport, the layers. Calling it packs the non-empty tensors ``live`` (numpy arrays), runs the same
    messages and kernel calls as the general schedule, and writes the result into ``dst`` (the tensors
    themselves, or a numpy output buffer)."""

    def __init__(self, comm, lcomm, group: Group, layers: list[int], span_array, count: int):
        self.comm, self.lcomm, self.group = comm, lcomm, group
        self.layers, self.span_array, self.count = layers, span_array, count
        self.program, self._buffers = None, None
        if lcomm is not None:
            self.role = schedule(lcomm.Get_size(), lcomm.Get_rank())
            self.transport = Transport(lcomm, group.adapter, group.device, staged=False)
            self.nbytes = group.size * (4 if group.dtype == "float32" else 8)
            if native_enabled() and self.nbytes < 1 << 31:
                self.program = self._program(lcomm)

    def _program(self, lcomm) -> np.ndarray:
        """The schedule as ``_kernels.small_doubling`` takes it (int64 fields, then 4 per level)."""
        def h(obj) -> int:  # the handle as a signed integer of its own width (MPICH's are 32-bit ints)
            bits = 8 * MPI._sizeof(obj)
            v = MPI._handleof(obj) & ((1 << bits) - 1)
            return v - (1 << bits) if v >> (bits - 1) else v

        out, fold, levels = -1, None, ()
        if self.role[0] == "out":
            out = self.role[1]
        else:
            fold, levels = self.role
        fold = fold or (-1, 0, 0)
        head = [h(lcomm), h(MPI.BYTE), h(MPI.INT64_T), h(MPI.MAX), _TAG, self.nbytes, out, *fold, len(levels)]
        return np.array(head + [int(x) for level in levels for x in level], dtype=np.int64)

    def compiled(self, live: list, dst, digest: int) -> int:
        """The whole call, agreement on ``digest`` included, in one ``_kernels.small_doubling``: 0, -1 if
        the ranks disagree (nothing was sent; every rank must then explain), or MPI's error code."""
        buf, scr = self.buffers()
        rc = _kernels.small_doubling(buf, scr, live, dst, self.span_array, self.program, digest)
        if rc == 0 and _transport._counters:
            fold, levels = (None, ()) if self.role[0] == "out" else self.role
            messages = 1 if self.role[0] == "out" else len(levels) + (fold is not None)
            _transport._record("scalar_bytes", AGREE_BYTES)
            _transport._record("sent_bytes", messages * self.nbytes, messages)
        return rc

    def buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """The fused and the receive buffer, as numpy arrays (views of torch CPU tensors' memory), kept
        until the pool changes."""
        kept = self._buffers
        if kept is not None and kept[0] == pool_generation():
            return kept[1], kept[2]
        g = self.group
        buf, scr = pooled(g, g.size, "fused"), pooled(g, g.size, "recv")
        if type(buf) is not np.ndarray:
            buf, scr = buf.numpy(), scr.numpy()
        self._buffers = (pool_generation(), buf, scr)
        return buf, scr

    def on(self, comm, lcomm) -> "SmallCall":
        """The same call on another communicator (``lcomm``: the library's duplicate of ``comm``)."""
        return SmallCall(comm, lcomm, self.group, self.layers, self.span_array, self.count)

    def live(self, items: list) -> list:
        return items if len(self.layers) == self.count else [items[i] for i in self.layers]

    def __call__(self, live: list, dst) -> None:
        t, sp = self.transport, self.span_array
        buf, scr = self.buffers()  # torch CPU tensors: numpy views of the same memory
        _kernels.copy(buf, live, sp)
        if self.role[0] == "out":
            t.send(buf, self.role[1])
            t.recv(dst, self.role[1])
            return
        fold, levels = self.role
        if fold is not None:
            t.recv(scr, fold[0])
            _kernels.pair(buf, scr, buf, sp, fold[1], fold[2])
        last = len(levels) - 1
        for i, (partner, count_left, count_right, upper) in enumerate(levels):
            t.sendrecv(buf, partner, scr, partner)
            _kernels.pair(scr if upper else buf, buf if upper else scr, dst if i == last else buf, sp,
                          count_left, count_right)
        if fold is not None:
            t.send(dst, fold[0])
