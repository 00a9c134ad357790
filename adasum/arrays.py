"""Array adapters: everything the algorithm needs from numpy arrays, torch tensors and cupy arrays.

The schedule in :mod:`adasum.halving` never looks at an array's kind. It asks an adapter for a flat fused
buffer, for per-layer partial dot products over a piece of it, for the in-place combine ``a ← ca·a + cb·b``,
and for an object MPI can read. Compute stays on the array's device; only the (layers × 3) float64 partial
sums cross to the host.

:class:`NumpyAdapter` serves numpy arrays, :class:`CupyAdapter` cupy arrays and :class:`TorchAdapter` torch
tensors on the CPU or a CUDA device.
"""

from __future__ import annotations

import functools
import math
import sys
import weakref
from typing import Any, Sequence

import numpy as np

from . import segmented as _segmented
from . import settings as _settings
from .combine import coefficients

__all__ = ["extend_range", "merge_partials", "partial_width", "Adapter", "Adapters", "CopyStream", "NumpyAdapter",
           "CupyAdapter", "TorchAdapter", "array_kind",
           "kernels_backend", "set_kernels_backend", "nonempty"]

from .native import compiled as _c_kernels  # None where the install could not build them



def _use_c(s: _settings.Settings) -> bool:
    return _c_kernels is not None and s.kernels == "c"


def kernels_backend() -> str:
    """``"c"`` when host float32/float64 buffers go through the compiled kernels under the current
    settings, else ``"numpy"``.

    The environment variable ``ADASUM_KERNELS=numpy`` (or :func:`set_kernels_backend`) selects the numpy
    kernels.
    """
    return "c" if _use_c(_settings.current()) else "numpy"


def set_kernels_backend(name: str) -> None:
    """Select ``"c"`` (the compiled kernels; ImportError if they were not built) or ``"numpy"``: the setting
    ``kernels`` of :func:`adasum.configure`."""
    if name == "c" and _c_kernels is None:
        raise ImportError("adasum._kernels was not built (no C compiler at install time?)")
    _settings.configure(kernels=name)

# Elements converted to float64 at a time: two such blocks (a and b) stay in a core's L2 cache, and no
# float64 copy of a whole buffer is ever made.
BLOCK = 1 << 15



class Adapter:
    """What the algorithm needs from one kind of array. Subclasses implement it for numpy/cupy and torch."""

    kind: str
    # The settings of the call in flight (:meth:`Adapters.use`); an adapter made on its own has the defaults.
    settings: _settings.Settings = _settings.Settings()

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
        given, is :func:`adasum.fusion.layer_spans` of the group (what the compiled copy takes)."""
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
    def partial_dots(self, a, b, pieces: Sequence[tuple[int, int]]) -> np.ndarray:
        """``[a·b, a·a, b·b]`` over ``a[s:e]``, ``b[s:e]`` for each piece, as a host float64 (n, 3) array;
        for float64 data an (n, 4) array ``[a·b, a·a, b·b, k]`` of partials scaled by ``4**-k``
        (:func:`extend_range`), so that no float64 input overflows or underflows them.

        ``a`` or ``b`` may also be a list with one flat buffer per piece, where :meth:`direct_parts` gave
        such buffers."""
        raise NotImplementedError

    def scaled_add(self, a, b, pieces: Sequence[tuple[int, int]], ca: np.ndarray, cb: np.ndarray,
                   dst=None) -> None:
        """``dst[s:e] ← ca[i]·a[s:e] + cb[i]·b[s:e]`` per piece (``dst`` defaults to ``a``), in float64,
        rounded once to the dtype. ``dst`` may be ``a`` or ``b``.

        Operands other than ``dst`` are scratch: their contents may be destroyed. Lists of per-piece
        buffers are taken where :meth:`partial_dots` takes them."""
        raise NotImplementedError

    def pair(self, left, right, dst, pieces, span_array: np.ndarray, count_left: int, count_right: int) -> None:
        """``dst[s:e] ← Adasum(left[s:e], right[s:e])`` per piece (the size-weighted rule), ``left`` standing for
        ``count_left`` ranks and ``right`` for ``count_right``. ``span_array`` is ``pieces`` as an int64
        (n, 2) array. ``dst`` may be ``left`` or ``right``; the other operand is scratch."""
        d = self.partial_dots(left, right, pieces)
        c_left, c_right = coefficients(d[:, 0], d[:, 1], d[:, 2], count_left, count_right)
        self.scaled_add(left, right, pieces, c_left, c_right, dst=dst)

    def direct_parts(self, tensors: Sequence[Any], dtype: str, contiguous: bool = False):
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
        """The numpy dtype of a buffer's elements (never a 16-bit float: those are reduced as float32)."""
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
    device so that they overlap the messages (:meth:`adasum.transport.Transport` sends a chunk while the
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


# On a device, blocks are larger: each block costs a few kernel launches.
DEVICE_BLOCK = 1 << 22
_KEPT_VIEWS = 8  # lists of torch CPU tensors whose numpy views TorchAdapter.host_views keeps


def _blocks(s: int, e: int, block: int = BLOCK):
    for bs in range(s, e, block):
        yield bs, min(bs + block, e)


class _NumpyLike(Adapter):
    """What numpy and cupy arrays share: the numpy API for packing, views, casts and dtypes."""

    def dtype_name(self, t) -> str:
        return _dtype_name(t.dtype)

    def pack(self, tensors, buf, bounds, spans=None):
        for t, s, e in zip(tensors, bounds[:-1], bounds[1:]):
            buf[s:e].reshape(t.shape)[...] = t

    def views(self, buf, bounds, shapes):
        return [buf[s:e].reshape(shape) for s, e, shape in zip(bounds[:-1], bounds[1:], shapes)]

    def write_back(self, tensors, buf, bounds, spans=None):
        for t, s, e in zip(tensors, bounds[:-1], bounds[1:]):
            t[...] = buf[s:e].reshape(t.shape)

    def numpy_dtype(self, buf):
        return np.dtype(buf.dtype)

    def astype(self, buf, dtype):
        return buf.astype(dtype)

    def copy_(self, dst, src):
        dst[...] = src


class NumpyAdapter(_NumpyLike):
    """numpy arrays (host memory)."""

    kind = "numpy"

    def __init__(self):
        self._scratch: dict = {}

    def clear(self) -> None:
        self._scratch.clear()

    def device(self, t) -> str:
        return "cpu"

    def empty(self, n, dtype, device):
        return np.empty(n, dtype=dtype)

    def pack(self, tensors, buf, bounds, spans=None):
        if spans is not None and _c_kernels is not None and buf.dtype.char in "fd":
            try:  # one memcpy per tensor; raises for a non-contiguous tensor
                _c_kernels.copy(buf, nonempty(tensors, spans[0]), spans[2])
                return
            except (BufferError, ValueError):
                pass
        # one C loop over all tensors (reshape(-1) is a view for contiguous ones)
        np.concatenate([t.reshape(-1) for t in tensors], out=buf)

    def write_back(self, tensors, buf, bounds, spans=None):
        if spans is not None and _c_kernels is not None and buf.dtype.char in "fd":
            try:
                _c_kernels.copy(nonempty(tensors, spans[0]), buf, spans[2])
                return
            except (BufferError, ValueError):
                pass
        super().write_back(tensors, buf, bounds)

    def fused_view(self, tensors, adjacent=False):
        live = [t for t in tensors if t.size]
        if adjacent and live and _c_kernels is not None:
            # Back to back, contiguous and writable already: cut the view from the array that owns the
            # memory, if it is one contiguous array that holds them all.
            root = _numpy_root(live[0])
            if isinstance(root, np.ndarray) and root.flags.c_contiguous and root.flags.writeable:
                start = _c_kernels.address(live[0]) - _c_kernels.address(root)
                nbytes = sum(t.nbytes for t in live)
                if 0 <= start and start + nbytes <= root.nbytes:
                    return root.reshape(-1).view(np.uint8)[start:start + nbytes].view(live[0].dtype)
        if not live or not all(t.flags.c_contiguous and t.flags.writeable for t in live):
            return None
        if len(live) > 1 and live[0].base is None:
            return None  # the first owns exactly its own memory: nothing can follow it in one block
        root = _numpy_root(live[0])
        end = live[0].__array_interface__["data"][0]
        for t in live:
            if t.__array_interface__["data"][0] != end or _numpy_root(t) is not root:
                return None
            end += t.nbytes
        total = sum(t.size for t in live)
        first = live[0].reshape(-1)
        return np.lib.stride_tricks.as_strided(first, shape=(total,), strides=(first.itemsize,))

    def layout(self, tensors, indices, rank):
        if _c_kernels is not None:
            try:  # raises for a read-only or a non-contiguous tensor
                return _c_kernels.layout(tensors, True)
            except (BufferError, ValueError):
                pass
        for i, t in zip(indices, tensors):
            if not t.flags.writeable:
                raise ValueError(f"rank {rank}: tensor {i} is read-only; adasum_allreduce_inplace writes the "
                                 "result into its tensors")
        return None

    def _block_scratch(self, name, dtype):
        buf = self._scratch.get(name)
        if buf is None:
            buf = self._scratch[name] = np.empty((2, BLOCK), dtype=dtype)
        return buf

    def _compiled(self, *operands) -> bool:
        return _use_c(self.settings) and all(type(x) is list or (x.dtype.char in "fd" and x.flags.c_contiguous)
                              for x in operands)

    def partial_dots(self, a, b, pieces):
        if self._compiled(a, b):
            out = np.empty((len(pieces), 3))
            _c_kernels.dots(a, b, np.asarray(pieces, dtype=np.int64).reshape(-1, 2), out)
        else:
            out = _numpy_partial_dots(a, b, pieces, self._block_scratch("wide64", np.float64))
        return extend_range(out, a, b, pieces) if _dtype_of(a) == np.float64 else out

    def scaled_add(self, a, b, pieces, ca, cb, dst=None):
        dst = a if dst is None else dst
        if self._compiled(dst, a, b):
            _c_kernels.scaled_add(dst, a, b, np.asarray(pieces, dtype=np.int64).reshape(-1, 2),
                                  np.ascontiguousarray(ca, dtype=np.float64),
                                  np.ascontiguousarray(cb, dtype=np.float64))
            return
        if dst is b:
            a, b = b, a  # compute into b's memory: the sum is symmetric in its two terms
            ca, cb = cb, ca
        _numpy_scaled_add(a, b, pieces, ca, cb, self._block_scratch("wide32", np.float32))
        if dst is not a:
            dst[...] = a

    def pair(self, left, right, dst, pieces, span_array, count_left, count_right):
        if self._compiled(left, right, dst):
            _c_kernels.pair(left, right, dst, span_array, count_left, count_right)
            return
        super().pair(left, right, dst, pieces, span_array, count_left, count_right)

    def direct_parts(self, tensors, dtype, contiguous=False):
        if not _use_c(self.settings) or dtype not in ("float32", "float64"):
            return None
        if not contiguous and not all(t.flags.c_contiguous for t in tensors):
            return None
        return list(tensors)

    def divide(self, buf, divisor):
        np.divide(buf, divisor, out=buf)

    def host_typed(self, buf):
        return buf

    def mpi_bytes(self, buf):
        return buf.view(np.uint8)

    def to_host(self, buf, host):
        host[...] = buf.view(np.uint8)

    def from_host(self, host, buf):
        buf.view(np.uint8)[...] = host


class CupyAdapter(_NumpyLike):
    """cupy arrays on a CUDA device; the arithmetic runs in cupy kernels on that device.

    Written against the numpy-compatible subset of cupy's API plus ``xp.cuda`` (devices and streams),
    ``ndarray.get``/``ndarray.set`` and a page-locked host allocator, so that the tests can run it on a
    numpy-backed stand-in module where no GPU exists.
    """

    kind = "cupy"

    def __init__(self, xp, pinned_empty=None):
        self.xp = xp
        self._pinned_empty = pinned_empty
        self._scratch: dict = {}
        self._segmented: _segmented.SegmentedKernels | None = None

    def clear(self) -> None:
        self._scratch.clear()
        if self._segmented is not None:
            self._segmented.clear()

    def _torch_views(self, *operands):
        """Zero-copy torch views (DLPack) of flat cupy buffers where they take the segmented Triton
        kernels under the setting ``device_kernels``, else None (the per-layer cupy kernels)."""
        setting = self.settings.device_kernels
        if setting == "per-layer" or not _segmented.wanted(setting, True):  # raises for "triton" without it
            return None
        torch = sys.modules["torch"]
        views = [torch.from_dlpack(x) for x in operands]
        if not _segmented.wanted(setting, views[0].is_cuda):
            return None
        if self._segmented is None:
            self._segmented = _segmented.SegmentedKernels(torch)
        return views

    def device(self, t) -> str:
        return f"cuda:{t.device.id}"

    def is_host(self, buf) -> bool:
        return False

    def _on(self, device: str):
        return self.xp.cuda.Device(int(device.split(":")[1]))

    def empty(self, n, dtype, device):
        with self._on(device):
            return self.xp.empty(n, dtype=dtype)

    def fused_view(self, tensors, adjacent=False):
        if len(tensors) == 1 and tensors[0].flags.c_contiguous:
            return tensors[0].reshape(-1)
        return None

    def _wide(self, like, which, dtype):
        key = (which, like.device.id, dtype)
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = self.empty(DEVICE_BLOCK, dtype, f"cuda:{like.device.id}")
        return buf

    def partial_dots(self, a, b, pieces):
        views = self._torch_views(a, b)
        if views is not None:
            out = self._segmented.dots(*views, pieces)
            return extend_range(out, *views, pieces) if a.dtype == self.xp.float64 else out
        xp = self.xp
        out = xp.zeros((len(pieces), 3), dtype=xp.float64)
        native = a.dtype == xp.float64
        x64, y64 = (None, None) if native else (self._wide(a, 0, "float64"), self._wide(a, 1, "float64"))
        for i, (s, e) in enumerate(pieces):
            for bs, be in _blocks(s, e, DEVICE_BLOCK):
                if native:
                    x, y = a[bs:be], b[bs:be]
                else:
                    x, y = x64[:be - bs], y64[:be - bs]
                    x[...] = a[bs:be]
                    y[...] = b[bs:be]
                out[i, 0] += xp.dot(x, y)
                out[i, 1] += xp.dot(x, x)
                out[i, 2] += xp.dot(y, y)
        out = xp.asnumpy(out)
        return extend_range(out, a, b, pieces) if native else out

    def scaled_add(self, a, b, pieces, ca, cb, dst=None):
        views = self._torch_views(a, b, a if dst is None else dst)
        if views is not None:
            self._segmented.combine(*views, pieces, ca, cb)
            return
        if dst is not None and dst is not a:
            self.scaled_add(a, b, pieces, ca, cb)
            dst[...] = a
            return
        xp = self.xp
        wide = a.dtype == xp.float16
        for (s, e), p, q in zip(pieces, ca.tolist(), cb.tolist()):
            for bs, be in _blocks(s, e, DEVICE_BLOCK):
                if wide:
                    x, y = self._wide(a, 0, "float32")[:be - bs], self._wide(a, 1, "float32")[:be - bs]
                    x[...] = a[bs:be]
                    y[...] = b[bs:be]
                else:
                    x, y = a[bs:be], b[bs:be]
                xp.multiply(x, x.dtype.type(p), out=x)
                xp.multiply(y, x.dtype.type(q), out=y)
                xp.add(x, y, out=x)
                if wide:
                    a[bs:be] = x

    def divide(self, buf, divisor):
        self.xp.divide(buf, divisor, out=buf)

    def mpi_bytes(self, buf):
        return buf.view(self.xp.uint8)

    def host_bytes_empty(self, nbytes, device):
        if self._pinned_empty is not None:
            return self._pinned_empty(nbytes)
        import cupyx  # cupy's page-locked host arrays

        return cupyx.empty_pinned((nbytes,), dtype=np.uint8)

    def to_host(self, buf, host):
        buf.view(self.xp.uint8).get(out=host)

    def from_host(self, host, buf):
        buf.view(self.xp.uint8).set(host)

    def synchronize(self, device):
        with self._on(device):
            self.xp.cuda.get_current_stream().synchronize()

    def _make_copy_stream(self, device):
        return _CupyCopyStream(self, device)


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


class _CupyCopyStream(CopyStream):
    def __init__(self, adapter, device):
        super().__init__(adapter)
        xp = adapter.xp
        self._device = device
        with adapter._on(device):
            self._stream = xp.cuda.Stream(non_blocking=True)
        self._events = _EventPool(lambda: xp.cuda.Event())

    def begin(self):
        self._events.reset()
        ready = self._events.take()
        with self.adapter._on(self._device):
            ready.record(self.adapter.xp.cuda.get_current_stream())
        self._stream.wait_event(ready)

    def to_host(self, buf, host):
        buf.get(stream=self._stream, out=host, blocking=False)
        mark = self._events.take()
        mark.record(self._stream)
        return mark

    def wait(self, mark):
        mark.synchronize()

    def from_host(self, host, buf):
        buf.set(host, stream=self._stream)

    def end(self):
        self._stream.synchronize()


class TorchAdapter(Adapter):
    """torch tensors on the CPU or a CUDA device; the arithmetic runs in torch on the tensor's device."""

    kind = "torch"

    def __init__(self, host: NumpyAdapter):
        import torch

        self.torch = torch
        self._numpy = host  # computes on the numpy views of CPU tensors
        self._scratch: dict = {}
        self._views: dict = {}
        self._segmented: _segmented.SegmentedKernels | None = None

    def clear(self) -> None:
        self._scratch.clear()
        self._views.clear()
        if self._segmented is not None:
            self._segmented.clear()

    def _segmented_for(self, *operands) -> _segmented.SegmentedKernels | None:
        """The segmented Triton kernels where flat tensor ``operands`` take them under the setting
        ``device_kernels``, else None (lists of host pieces never do)."""
        setting = self.settings.device_kernels
        if setting == "per-layer" or any(type(x) is list for x in operands):
            return None
        if not _segmented.wanted(setting, operands[0].device.type == "cuda"):
            return None
        if self._segmented is None:
            self._segmented = _segmented.SegmentedKernels(self.torch)
        return self._segmented

    def refusal(self, t) -> str | None:
        # Each of these passes torch's own checks until data is copied, mid-call; the agreement must know first.
        if t.is_nested:
            return "is a nested tensor; adasum reduces dense tensors (pass its components as tensors of their own)"
        if t.layout != self.torch.strided:
            return f"is a sparse tensor (layout {t.layout}); adasum reduces dense tensors (pass t.to_dense())"
        if t.is_quantized:
            return f"is a quantized tensor (dtype {t.dtype}); adasum reduces floats (pass t.dequantize())"
        if t.device.type == "meta":
            return "is on the meta device, which holds no data"
        return None

    def dtype_name(self, t) -> str:
        return str(t.dtype).replace("torch.", "")

    def device(self, t) -> str:
        return str(t.device)

    def is_host(self, buf) -> bool:
        return buf.device.type == "cpu"

    def _dtype(self, name):
        return getattr(self.torch, name)

    def empty(self, n, dtype, device):
        return self.torch.empty(n, dtype=self._dtype(dtype), device=device)

    def pack(self, tensors, buf, bounds, spans=None):
        with self.torch.no_grad():
            for t, s, e in zip(tensors, bounds[:-1], bounds[1:]):
                buf[s:e].view(t.shape).copy_(t)

    def views(self, buf, bounds, shapes):
        return [buf[s:e].view(shape) for s, e, shape in zip(bounds[:-1], bounds[1:], shapes)]

    def write_back(self, tensors, buf, bounds, spans=None):
        with self.torch.no_grad():
            for t, s, e in zip(tensors, bounds[:-1], bounds[1:]):
                t.copy_(buf[s:e].view(t.shape))

    def fused_view(self, tensors, adjacent=False):
        live = [t for t in tensors if t.numel()]
        if not live or not all(t.is_contiguous() for t in live):
            return None
        storage = live[0].untyped_storage().data_ptr()
        offset = live[0].storage_offset()
        for t in live:
            if t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
                return None
            offset += t.numel()
        total = sum(t.numel() for t in live)
        return self.torch.as_strided(live[0].detach(), (total,), (1,), live[0].storage_offset())

    def _wide(self, like, which, dtype):
        key = (which, like.device, dtype)
        buf = self._scratch.get(key)
        if buf is None:
            n = BLOCK if like.device.type == "cpu" else DEVICE_BLOCK
            buf = self._scratch[key] = self.torch.empty(n, dtype=dtype, device=like.device)
        return buf

    def _block(self, like) -> int:
        return BLOCK if like.device.type == "cpu" else DEVICE_BLOCK

    def _numpy_path(self, x) -> bool:
        """Whether an operand is computed on by the numpy adapter: host memory of a dtype numpy has (lists
        are flat numpy views of the caller's CPU tensors, from :meth:`direct_parts`)."""
        return type(x) is list or (x.device.type == "cpu" and x.dtype != self.torch.bfloat16)

    def layout(self, tensors, indices, rank):
        views = self._host_views(tensors)
        return None if views is None else self._numpy.layout(views, indices, rank)

    def direct_parts(self, tensors, dtype, contiguous=False):
        if not contiguous and not all(t.is_contiguous() for t in tensors):
            return None
        views = self._host_views(tensors)
        return None if views is None else self._numpy.direct_parts(views, dtype, contiguous=True)

    def _host_views(self, tensors):
        """numpy views of CPU float32/float64 tensors (their own memory), else None."""
        torch = self.torch
        if not tensors or tensors[0].device.type != "cpu" or tensors[0].dtype not in (torch.float32, torch.float64):
            return None
        return self.host_views(tensors)

    def host_views(self, tensors) -> list:
        """numpy views of the memory of CPU tensors of one dtype, kept while the same tensor objects come
        back with the same memory, shape and contiguity: making them costs microseconds per tensor, as
        much as the rest of a small call. Views of a few lists are kept, for loops that reduce several;
        a list's views are dropped as soon as one of its tensors is freed."""
        key = id(tensors[0]) if tensors else 0
        kept = self._views.get(key)
        if kept is not None and len(kept[0]) == len(tensors):
            for (ref, address, shape), t in zip(kept[0], tensors):
                if ref() is not t or t.data_ptr() != address or not t.is_contiguous() or t.shape != shape:
                    break
            else:
                return kept[1]
        views = [t.detach().numpy() for t in tensors]
        entry = [None, views]  # [(weak reference, address, shape) per tensor, views]

        def forget(_, key=key):  # a tensor is gone: its views must not keep its memory alive
            if self._views.get(key) is entry:
                del self._views[key]

        try:
            entry[0] = [(weakref.ref(t, forget), t.data_ptr(), t.shape) for t in tensors]
        except TypeError:  # a tensor subclass without weak references: not kept
            return views
        if len(self._views) >= _KEPT_VIEWS:
            self._views.pop(next(iter(self._views)))
        self._views[key] = entry
        return views

    def kept_view_lists(self) -> int:
        """How many lists of tensors have their numpy views kept now."""
        return len(self._views)

    def wrote_parts(self, tensors) -> None:
        # The result went into the tensors' memory through numpy: tell autograd they changed in place.
        self.torch.autograd.graph.increment_version(tensors)

    def partial_dots(self, a, b, pieces):
        torch = self.torch
        fast = self._segmented_for(a, b)
        if fast is not None:
            out = fast.dots(a, b, pieces)
            return extend_range(out, a, b, pieces) if a.dtype == torch.float64 else out
        if self._numpy_path(a):
            # numpy's kernels, on the same memory: they vectorise over many small layers
            return self._numpy.partial_dots(_host(a), _host(b), pieces)
        out = torch.zeros((len(pieces), 3), dtype=torch.float64, device=a.device)
        native = a.dtype == torch.float64
        if not native:
            x64, y64 = self._wide(a, 0, torch.float64), self._wide(a, 1, torch.float64)
        for i, (s, e) in enumerate(pieces):
            row = out[i]
            for bs, be in _blocks(s, e, self._block(a)):
                if native:
                    x, y = a[bs:be], b[bs:be]
                else:
                    x, y = x64[:be - bs], y64[:be - bs]
                    x.copy_(a[bs:be])
                    y.copy_(b[bs:be])
                row[0] += torch.dot(x, y)
                row[1] += torch.dot(x, x)
                row[2] += torch.dot(y, y)
        out = out.cpu().numpy()
        return extend_range(out, a, b, pieces) if native else out

    def pair(self, left, right, dst, pieces, span_array, count_left, count_right):
        if self._numpy_path(left) and self._segmented_for(left, right, dst) is None:
            self._numpy.pair(_host(left), _host(right), _host(dst), pieces, span_array, count_left, count_right)
            return
        super().pair(left, right, dst, pieces, span_array, count_left, count_right)

    def scaled_add(self, a, b, pieces, ca, cb, dst=None):
        torch = self.torch
        fast = self._segmented_for(a, b, a if dst is None else dst)
        if fast is not None:
            fast.combine(a, b, a if dst is None else dst, pieces, ca, cb)
            return
        if self._numpy_path(a):
            self._numpy.scaled_add(_host(a), _host(b), pieces, ca, cb, None if dst is None else _host(dst))
            return
        if dst is not None and dst is not a:
            self.scaled_add(a, b, pieces, ca, cb)
            dst.copy_(a)
            return
        if a.dtype in (torch.float32, torch.float64):
            for (s, e), p, q in zip(pieces, ca.tolist(), cb.tolist()):
                a[s:e].mul_(p).add_(b[s:e], alpha=q)
            return
        # 16-bit: widen to float32 block by block so that the result is rounded to the dtype only once
        x32, y32 = self._wide(a, 0, torch.float32), self._wide(a, 1, torch.float32)
        for (s, e), p, q in zip(pieces, ca.tolist(), cb.tolist()):
            for bs, be in _blocks(s, e, self._block(a)):
                x, y = x32[:be - bs], y32[:be - bs]
                x.copy_(a[bs:be])
                y.copy_(b[bs:be])
                x.mul_(p).add_(y, alpha=q)
                a[bs:be].copy_(x)

    def divide(self, buf, divisor):
        buf.div_(divisor)

    def host_typed(self, buf):
        return buf.numpy()

    def numpy_dtype(self, buf):
        return np.dtype(self.dtype_name(buf))

    def astype(self, buf, dtype):
        return buf.to(self._dtype(dtype))

    def copy_(self, dst, src):
        dst.copy_(src)

    def mpi_bytes(self, buf):
        u8 = buf.view(self.torch.uint8)
        return u8.numpy() if buf.device.type == "cpu" else u8

    def host_bytes_empty(self, nbytes, device):
        torch = self.torch
        pin = device.startswith("cuda")
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).numpy()

    def to_host(self, buf, host):
        torch = self.torch
        torch.from_numpy(host).copy_(buf.view(torch.uint8))

    def from_host(self, host, buf):
        torch = self.torch
        buf.view(torch.uint8).copy_(torch.from_numpy(host), non_blocking=False)

    def synchronize(self, device):
        if device.startswith("cuda"):
            self.torch.cuda.synchronize(device)

    def byte_view(self, buf):
        return buf.view(self.torch.uint8)

    def _make_copy_stream(self, device):
        return _TorchCopyStream(self, device) if device.startswith("cuda") else CopyStream(self)


class _TorchCopyStream(CopyStream):
    def __init__(self, adapter, device):
        super().__init__(adapter)
        torch = adapter.torch
        self._torch = torch
        self._device = torch.device(device)
        self._stream = torch.cuda.Stream(device=self._device)
        self._events = _EventPool(torch.cuda.Event)

    def begin(self):
        self._events.reset()
        self._stream.wait_stream(self._torch.cuda.current_stream(self._device))

    def to_host(self, buf, host):
        torch = self._torch
        with torch.cuda.stream(self._stream):
            torch.from_numpy(host).copy_(buf, non_blocking=True)
            mark = self._events.take()
            mark.record(self._stream)
        return mark

    def wait(self, mark):
        mark.synchronize()

    def from_host(self, host, buf):
        torch = self._torch
        with torch.cuda.stream(self._stream):
            buf.copy_(torch.from_numpy(host), non_blocking=True)

    def end(self):
        self._stream.synchronize()


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype) -> str:
    # numpy's dtype.name is computed in Python on every access; a call may describe thousands of tensors
    return np.dtype(dtype).name


def _host(x):
    """A CPU operand for the numpy adapter: a tensor's memory as numpy, or a list of numpy pieces."""
    return x if type(x) is list else x.numpy()


def nonempty(tensors, layers):
    """The tensors of the non-empty ``layers`` (all of them, as they mostly are)."""
    return tensors if len(layers) == len(tensors) else [tensors[i] for i in layers]


def _numpy_root(t):
    while isinstance(t.base, np.ndarray):
        t = t.base
    return t.base if t.base is not None else t


def _numpy_blocks(n: int, pieces):
    """Blocks of at most ``BLOCK`` elements over ``[0, n)``, with the pieces that fall into each.

    ``pieces`` must partition ``[0, n)`` in order. Yields ``(bs, be, i0, cuts)``: the block's range, the
    index of the first piece in it and the offsets where pieces start inside the block (``None`` when the
    block lies inside one piece). Many small layers are thus handled by a few vectorised calls per block.
    """
    starts = np.fromiter((s for s, _ in pieces), dtype=np.int64, count=len(pieces))
    for bs in range(0, n, BLOCK):
        be = min(bs + BLOCK, n)
        i0 = int(np.searchsorted(starts, bs, side="right")) - 1
        i1 = int(np.searchsorted(starts, be, side="left"))
        yield bs, be, i0, (None if i1 - i0 == 1 else np.maximum(starts[i0:i1], bs) - bs)


# Below this a squared norm may have lost bits to underflow (its elements' squares are subnormal), or be zero
# only because they all underflowed: such partials are computed again on the data scaled by a power of two.
TINY = 2.0 ** -900
# The exponent of partials that are all zero: they take no part in choosing a common scale.
NO_SCALE = -(2.0 ** 30)


def partial_width(dtype: str) -> int:
    """Columns of a group's partials: 4 for float64 (:func:`extend_range`), else 3."""
    return 4 if dtype == "float64" else 3


def _dtype_of(x):
    return x[0].dtype if type(x) is list else x.dtype


def extend_range(part: np.ndarray, a, b, pieces) -> np.ndarray:
    """Float64 partials ``part`` (n, 3) as (n, 4) rows ``[a·b, a·a, b·b, k]`` meaning ``4**k`` times the
    first three, as BLAS's ``nrm2`` scales: a row that overflowed (Inf/NaN from finite data) or whose squared
    norms are below :data:`TINY` is computed again on its piece scaled by ``2**-k``, where ``2**k`` bounds
    its largest magnitude; the scaling is exact, and the Adasum coefficients only use ratios of partials of
    one scale. Other rows keep k = 0 (bitwise what they were), all-zero rows ``NO_SCALE``. ``a``, ``b``: flat
    buffers the pieces index (numpy, cupy or torch), or lists of one buffer per piece."""
    out = np.empty((len(part), 4))
    out[:, :3] = part
    out[:, 3] = 0.0
    with np.errstate(invalid="ignore"):
        redo = ~np.isfinite(part).all(axis=1) | (part[:, 1] < TINY) | (part[:, 2] < TINY)
    for i in np.flatnonzero(redo).tolist():
        s, e = pieces[i]
        x = a[i] if type(a) is list else a[s:e]
        y = b[i] if type(b) is list else b[s:e]
        m = max(float(abs(x).max()), float(abs(y).max())) if e > s else 0.0
        if m == 0.0:
            out[i] = (0.0, 0.0, 0.0, NO_SCALE)
        elif math.isfinite(m):  # NaN or Inf in the data: the partials stay non-finite, on purpose
            k = math.frexp(m)[1]
            xs, ys = _scale_down(x, k), _scale_down(y, k)
            out[i] = (float((xs * ys).sum()), float((xs * xs).sum()), float((ys * ys).sum()), k)
    return out


def _scale_down(x, k: int):
    """``x · 2**-k``, exact where the result is normal. Subnormal data has ``2**-k`` beyond the float64
    range: it is then scaled up in two steps (as the compiled kernel does)."""
    if k >= -1020:
        return x * math.ldexp(1.0, -k)
    half = -k // 2
    return x * math.ldexp(1.0, half) * math.ldexp(1.0, -k - half)


def _shift(k: np.ndarray, top: np.ndarray) -> np.ndarray:
    """Powers of two that bring partials of scale ``4**k`` to scale ``4**top`` (``top >= k``)."""
    return np.maximum(2 * (k - top), -4000).astype(np.int64)[:, None]


def merge_partials(first: np.ndarray, second: np.ndarray, widths) -> np.ndarray:
    """``first + second`` for flattened partials of several groups (``widths``: (rows, 3 or 4) per group):
    3-wide rows add; 4-wide rows (:func:`extend_range`) are brought to their larger scale first. The same
    operations in the same order whatever the data, so every rank adding the same two gets the same bits."""
    out = first + second
    at = 0
    for rows, width in widths:
        if width == 4 and rows:
            f = first[at:at + 4 * rows].reshape(rows, 4)
            g = second[at:at + 4 * rows].reshape(rows, 4)
            if (f[:, 3] != g[:, 3]).any():
                k = np.maximum(f[:, 3], g[:, 3])
                both = np.ldexp(f[:, :3], _shift(f[:, 3], k)) + np.ldexp(g[:, :3], _shift(g[:, 3], k))
                o = out[at:at + 4 * rows].reshape(rows, 4)
                o[:, :3] = both
                o[:, 3] = k
            else:
                out[at + 3:at + 4 * rows:4] = f[:, 3]
        at += width * rows
    return out


def _numpy_partial_dots(a, b, pieces, gram_scratch) -> np.ndarray:
    """Per piece [a·b, a·a, b·b], accumulated in float64 (narrower inputs are widened block by block)."""
    out = np.zeros((len(pieces), 3))
    native = a.dtype == np.float64
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):  # extend_range redoes such partials
        _numpy_dots_into(out, a, b, pieces, native, gram_scratch)
    return out


def _numpy_dots_into(out, a, b, pieces, native, gram_scratch) -> None:
    for bs, be, i0, cuts in _numpy_blocks(len(a), pieces):
        if native:
            x, y = a[bs:be], b[bs:be]
        else:
            m = gram_scratch[:, :be - bs]
            m[0] = a[bs:be]
            m[1] = b[bs:be]
            x, y = m[0], m[1]
        if cuts is not None:
            i1 = i0 + len(cuts)
            out[i0:i1, 0] += np.add.reduceat(x * y, cuts)
            out[i0:i1, 1] += np.add.reduceat(x * x, cuts)
            out[i0:i1, 2] += np.add.reduceat(y * y, cuts)
        else:
            out[i0] += (np.dot(x, y), np.dot(x, x), np.dot(y, y))


def _numpy_scaled_add(a, b, pieces, ca, cb, f32_scratch) -> None:
    """``a ← ca·a + cb·b`` per piece. float32/float64 compute in their own precision (the result is
    within an ulp or two of the exact value); float16 is widened to float32 block by block."""
    wide = a.dtype == np.float16
    for bs, be, i0, cuts in _numpy_blocks(len(a), pieces):
        if wide:
            x, y = f32_scratch[0, :be - bs], f32_scratch[1, :be - bs]
            x[...] = a[bs:be]
            y[...] = b[bs:be]
        else:
            x, y = a[bs:be], b[bs:be]
        if cuts is None:
            # scalars of the array's own type, so that the ufuncs run a float32 loop for float32 data
            p, q = x.dtype.type(ca[i0]), x.dtype.type(cb[i0])
        else:
            lengths = np.diff(np.append(cuts, be - bs))
            i1 = i0 + len(cuts)
            p = np.repeat(ca[i0:i1].astype(x.dtype), lengths)
            q = np.repeat(cb[i0:i1].astype(x.dtype), lengths)
        np.multiply(x, p, out=x, casting="unsafe")
        np.multiply(y, q, out=y, casting="unsafe")
        np.add(x, y, out=x)
        if wide:
            a[bs:be] = x


class Adapters:
    """One set of adapters (numpy, and torch and cupy once their arrays appear), with their scratch and kept
    views: each communicator's context has its own, so calls on different communicators share none."""

    def __init__(self) -> None:
        self.numpy = NumpyAdapter()
        self._made: dict[str, Adapter] = {"numpy": self.numpy}

    def of(self, kind: str) -> Adapter:
        adapter = self._made.get(kind)
        if adapter is None:
            if kind == "torch":
                adapter = TorchAdapter(self.numpy)
            elif kind == "cupy":
                cupy = sys.modules["cupy"]
                adapter = CupyAdapter(cupy, getattr(cupy, "_adasum_pinned_empty", None))
            else:
                raise ValueError(f"no adapter for arrays of kind {kind!r}")
            adapter.settings = self.numpy.settings
            self._made[kind] = adapter
        return adapter

    def use(self, s: _settings.Settings) -> None:
        """Bind the settings ``s`` of the call that starts to every adapter."""
        for adapter in self._made.values():
            adapter.settings = s

    def for_array(self, t) -> Adapter | None:
        """The adapter for array ``t``, or None if ``t`` is of no supported kind."""
        kind = array_kind(t)
        return None if kind is None else self.of(kind)

    def clear(self) -> None:
        for adapter in self._made.values():
            adapter.clear()


def array_kind(t) -> str | None:
    """``"numpy"``, ``"torch"`` or ``"cupy"`` for an array of a supported kind, else None.

    torch and cupy are looked up only if the user's program has imported them: an object cannot be a
    torch tensor unless torch is loaded.
    """
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(t, cupy.ndarray):  # first: cupy's test stand-in is made of numpy
        return "cupy"
    if isinstance(t, np.ndarray):
        return "numpy"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        return "torch"
    return None
