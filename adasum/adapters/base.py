"""The adapter interface: everything the schedules need from one kind of array, and the side stream of
staged copies. :class:`Adapter` says what; :mod:`.host`, :mod:`.cupy_arrays` and :mod:`.torch_tensors`
implement it."""

from __future__ import annotations

import functools
import sys
from typing import Any, Sequence

import numpy as np

from .. import settings as _settings
from ..rule.combine import coefficients
from ..kernels.native import compiled as _c_kernels  # None where the install could not build them


def use_c(s: _settings.Settings) -> bool:
    """Whether host float buffers (float32, float64, float16, bfloat16) go through the compiled kernels under
    the settings ``s``."""
    return _c_kernels is not None and s.kernels == "c"


# Elements converted to float64 at a time: two such blocks (a and b) stay in a core's L2 cache, and no
# float64 copy of a whole buffer is ever made.
BLOCK = 1 << 15



class Adapter:
    """What the algorithm needs from one kind of array. Subclasses implement it for numpy/cupy and torch."""

    kind: str

    def clear(self) -> None:
        """Drop kept scratch buffers and views."""

    # --- describing user arrays -------------------------------------------------------------------------
    def refusal(self, t) -> str | None:
        """Why array ``t`` of this kind cannot be reduced although its type is supported (completing
        "tensor i ..."), or None. Read before anything else of ``t``: its shape may not exist."""
        return None

    def dtype_name(self, t) -> str:
        raise NotImplementedError

    def device(self, t) -> str:
        raise NotImplementedError

    # --- fused buffers ------------------------------------------------------------------------------------
    def empty(self, n: int, dtype: str, device: str):
        raise NotImplementedError

    def pack(self, tensors: Sequence[Any], buf, bounds: np.ndarray, spans=None) -> None:
        """Copy each tensor (any strides) into its slice ``buf[bounds[i]:bounds[i+1]]``. ``spans``, if
        given, is :func:`adasum.schedules.fusion.layer_spans` of the group (what the compiled copy takes)."""
        raise NotImplementedError

    def views(self, buf, bounds: np.ndarray, shapes: Sequence[tuple[int, ...]]) -> list:
        """One view of ``buf`` per layer, in that layer's shape."""
        raise NotImplementedError

    def write_back(self, tensors: Sequence[Any], buf, bounds: np.ndarray, spans=None) -> None:
        """Copy each layer of ``buf`` back into the user's tensor (which may be non-contiguous); ``spans``
        as for :meth:`pack`."""
        raise NotImplementedError

    def fused_view(self, tensors: Sequence[Any], adjacent: bool = False):
        """A flat view over ``tensors`` if they lie back to back, in order, in one contiguous block of one
        allocation (views of one flat buffer, a single contiguous tensor); otherwise None. ``adjacent``:
        :meth:`layout` found them back to back.

        An in-place call on such tensors works on their memory directly, with no copy in or out.
        """
        raise NotImplementedError

    # --- arithmetic on flat buffers -------------------------------------------------------------------------
    def partial_dots(self, a, b, pieces: Sequence[tuple[int, int]], *, s: _settings.Settings) -> np.ndarray:
        """``[a·b, a·a, b·b]`` over ``a[s:e]``, ``b[s:e]`` for each piece, as a host float64 (n, 3) array;
        for float64 data an (n, 4) array ``[a·b, a·a, b·b, k]`` of partials scaled by ``4**-k``
        (:func:`extend_range`), so that no float64 input overflows or underflows them.

        ``a`` or ``b`` may also be a list with one flat buffer per piece, where :meth:`direct_parts` gave
        such buffers. ``s``: the settings of the call (which kernels)."""
        raise NotImplementedError

    def scaled_add(self, a, b, pieces: Sequence[tuple[int, int]], ca: np.ndarray, cb: np.ndarray,
                   dst=None, *, s: _settings.Settings) -> None:
        """``dst[s:e] ← ca[i]·a[s:e] + cb[i]·b[s:e]`` per piece (``dst`` defaults to ``a``), in float64,
        rounded once to the dtype. ``dst`` may be ``a`` or ``b``.

        Operands other than ``dst`` are scratch: their contents may be destroyed. Lists of per-piece
        buffers are taken where :meth:`partial_dots` takes them."""
        raise NotImplementedError

    def pair(self, left, right, dst, pieces, span_array: np.ndarray, count_left: int, count_right: int, *,
             s: _settings.Settings) -> None:
        """``dst[s:e] ← Adasum(left[s:e], right[s:e])`` per piece (the size-weighted rule), ``left`` standing for
        ``count_left`` ranks and ``right`` for ``count_right``. ``span_array`` is ``pieces`` as an int64
        (n, 2) array. ``dst`` may be ``left`` or ``right``; the other operand is scratch."""
        d = self.partial_dots(left, right, pieces, s=s)
        c_left, c_right = coefficients(d[:, 0], d[:, 1], d[:, 2], count_left, count_right)
        self.scaled_add(left, right, pieces, c_left, c_right, dst=dst, s=s)

    def direct_parts(self, tensors: Sequence[Any], dtype: str, contiguous: bool = False, *,
                     s: _settings.Settings):
        """``tensors`` (as a list) where the arithmetic and the transport can use them in place of a
        packed buffer, or None where this adapter (or this dtype, or a non-contiguous tensor) needs them
        packed. ``contiguous``: the caller has checked that every tensor is C-contiguous."""
        return None

    def wrote_parts(self, tensors: Sequence[Any]) -> None:
        """The result of a call was written into ``tensors`` through the views :meth:`direct_parts` gave."""

    def layout(self, tensors: Sequence[Any], indices: Sequence[int], rank: int) -> int | None:
        """Where an in-place call's ``tensors`` lie: 2 back to back, in order, in one block; 1 apart; 0
        overlapping; None where this adapter does not tell. ``indices`` are the tensors' places in the call.

        Raises ValueError (naming ``rank`` and the tensor) for a tensor the call cannot write into."""
        return None

    def divide(self, buf, divisor: int) -> None:
        """``buf ← buf / divisor`` in place (floating point buffers only)."""
        raise NotImplementedError

    def host_typed(self, buf) -> np.ndarray:
        """A numpy view of a host buffer with its own element type (for MPI reductions)."""
        raise NotImplementedError

    def numpy_dtype(self, buf) -> np.dtype:
        """The numpy dtype of a buffer's elements (never a 16-bit float: those are summed as float32)."""
        raise NotImplementedError

    def astype(self, buf, dtype: str):
        """A new flat buffer with ``buf``'s values in ``dtype``."""
        raise NotImplementedError

    def copy_(self, dst, src) -> None:
        """``dst[...] = src`` elementwise, casting to dst's dtype."""
        raise NotImplementedError

    # --- transport ----------------------------------------------------------------------------------------
    def is_host(self, buf) -> bool:
        return True

    def mpi_bytes(self, buf):
        """An object mpi4py reads as the raw bytes of the flat buffer ``buf`` (host, or device memory for
        CUDA-aware MPI)."""
        raise NotImplementedError

    def host_bytes_empty(self, nbytes: int, device: str) -> np.ndarray:
        """A host staging area of ``nbytes`` bytes (page-locked where the device allows)."""
        return np.empty(nbytes, dtype=np.uint8)

    def to_host(self, buf, host: np.ndarray) -> None:
        """Copy the bytes of flat ``buf`` into the host array ``host`` (uint8) and wait for the copy."""
        raise NotImplementedError

    def from_host(self, host: np.ndarray, buf) -> None:
        """Copy host bytes into the flat buffer ``buf``."""
        raise NotImplementedError

    def synchronize(self, device: str) -> None:
        """Wait for queued device work, so that MPI reads finished data."""

    def byte_view(self, buf):
        """The flat buffer ``buf`` as a flat buffer of its bytes (uint8), of the same kind and device."""
        return buf.view(np.uint8)

    def copy_stream(self, device: str) -> "CopyStream":
        """The :class:`CopyStream` of staged transfers on ``device``, made once and kept with the adapter."""
        key = ("copy stream", device)
        stream = self._scratch.get(key)
        if stream is None:
            stream = self._scratch[key] = self._make_copy_stream(device)
        return stream

    def _make_copy_stream(self, device: str) -> "CopyStream":
        return CopyStream(self)


class CopyStream:
    """Copies between device buffers and host bytes for staged transfers, queued on a side stream of the
    device so that they overlap the messages (:meth:`adasum.runtime.transport.Transport` sends a chunk while the
    next is copied). This base class copies at once, for host buffers; device adapters queue the copies and
    mark them with events, which it keeps and reuses.

    A transfer is :meth:`begin` (the side stream waits for the work queued so far), copies, and :meth:`end`
    (the host waits for every copy queued on the side stream)."""

    def __init__(self, adapter: "Adapter"):
        self.adapter = adapter

    def begin(self) -> None:
        pass

    def to_host(self, buf, host: np.ndarray):
        """Queue ``host ← buf`` (bytes); returns a mark for :meth:`wait`."""
        self.adapter.to_host(buf, host)

    def wait(self, mark) -> None:
        """Wait on the host until the copy that returned ``mark`` is done."""

    def from_host(self, host: np.ndarray, buf) -> None:
        """Queue ``buf ← host`` (bytes)."""
        self.adapter.from_host(host, buf)

    def end(self) -> None:
        pass


class _EventPool:
    """Events reused from one transfer to the next: ``take`` hands out the next, making one only when a
    transfer has more chunks than any before it."""

    def __init__(self, make):
        self._make = make
        self._events: list = []
        self._used = 0

    def reset(self) -> None:
        self._used = 0

    def take(self):
        if self._used == len(self._events):
            self._events.append(self._make())
        self._used += 1
        return self._events[self._used - 1]


class DeviceCopyStream(CopyStream):
    """The copy stream of a device adapter: copies queued on the side stream ``stream``, every copy to the
    host marked with an event (made by ``make_event``, kept and reused from call to call). The device's own
    calls come in as functions: ``follow(stream, events)`` makes the side stream wait for the work queued so
    far, ``copy_to_host(stream, buf, host)`` and ``copy_from_host(stream, host, buf)`` queue the copies."""

    def __init__(self, adapter: "Adapter", stream, make_event, follow, copy_to_host, copy_from_host):
        super().__init__(adapter)
        self._stream = stream
        self._events = _EventPool(make_event)
        self._follow, self._to_host, self._from_host = follow, copy_to_host, copy_from_host

    def begin(self) -> None:
        self._events.reset()
        self._follow(self._stream, self._events)

    def to_host(self, buf, host: np.ndarray):
        self._to_host(self._stream, buf, host)
        mark = self._events.take()
        mark.record(self._stream)
        return mark

    def wait(self, mark) -> None:
        mark.synchronize()

    def from_host(self, host: np.ndarray, buf) -> None:
        self._from_host(self._stream, host, buf)

    def end(self) -> None:
        self._stream.synchronize()


# On a device, blocks are larger: each block costs a few kernel launches.
DEVICE_BLOCK = 1 << 22
_KEPT_VIEWS = 8  # lists of torch CPU tensors whose numpy views TorchAdapter.host_views keeps


def per_layer_dots(out, a, b, pieces, block: int, dot, wide=None) -> None:
    """The per-layer device kernels' partial dot products (torch and cupy): adds ``[a·b, a·a, b·b]`` of
    every piece to its row of ``out`` (float64, on the device), block by block with the array module's
    ``dot``, in float64: ``wide`` holds two float64 scratch blocks where ``a`` and ``b`` are narrower (None:
    they are float64 already)."""
    for i, (s, e) in enumerate(pieces):
        row = out[i]
        for bs, be in _blocks(s, e, block):
            if wide is None:
                x, y = a[bs:be], b[bs:be]
            else:
                x, y = wide[0][:be - bs], wide[1][:be - bs]
                x[...] = a[bs:be]
                y[...] = b[bs:be]
            row[0] += dot(x, y)
            row[1] += dot(x, x)
            row[2] += dot(y, y)


def _blocks(s: int, e: int, block: int = BLOCK):
    for bs in range(s, e, block):
        yield bs, min(bs + block, e)



@functools.lru_cache(maxsize=None)
def _dtype_name(dtype) -> str:
    # numpy's dtype.name is computed in Python on every access; a call may describe thousands of tensors
    return np.dtype(dtype).name


def _host(x):
    """A CPU operand for the numpy adapter: a tensor's memory as numpy (a bfloat16 tensor's as its uint16
    bits, which the kernels take for bfloat16), or a list of numpy pieces."""
    if type(x) is list or type(x) is np.ndarray:
        return x
    if x.dtype is sys.modules["torch"].bfloat16:
        return x.view(sys.modules["torch"].uint16).numpy()
    return x.numpy()


host_numpy = _host


def nonempty(tensors, layers):
    """The tensors of the non-empty ``layers`` (all of them, as they mostly are)."""
    return tensors if len(layers) == len(tensors) else [tensors[i] for i in layers]


