"""numpy arrays: the host adapter, whose float work goes through the compiled kernels (or the numpy kernels
below, which do the same operations), and the base of the cupy adapter. float16 arrays are computed on as
they are, bfloat16 ones (torch's, on the CPU) as their uint16 bits: widened to float64 as they are read,
the combine rounded once to the 16-bit type."""

from __future__ import annotations

import numpy as np

from ..rule.combine import extend_range, dtype_of
from ..rule.sixteen import SIXTEEN, narrow, widen
from ..kernels.native import compiled as _c_kernels  # None where the install could not build them
from .base import BLOCK, Adapter, _dtype_name, nonempty, use_c


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
        if spans is not None and _c_kernels is not None and buf.dtype.char in _KERNEL_TYPES:
            try:  # one memcpy per tensor; raises for a non-contiguous tensor
                _c_kernels.copy(buf, nonempty(tensors, spans[0]), spans[2])
                return
            except (BufferError, ValueError):
                pass
        # one C loop over all tensors (reshape(-1) is a view for contiguous ones)
        np.concatenate([t.reshape(-1) for t in tensors], out=buf)

    def write_back(self, tensors, buf, bounds, spans=None):
        if spans is not None and _c_kernels is not None and buf.dtype.char in _KERNEL_TYPES:
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

    def _compiled(self, s, *operands) -> bool:
        return use_c(s) and all(type(x) is list or (x.dtype.char in _KERNEL_TYPES and x.flags.c_contiguous)
                              for x in operands)

    def partial_dots(self, a, b, pieces, *, s):
        if self._compiled(s, a, b):
            out = np.empty((len(pieces), 3))
            _c_kernels.dots(a, b, np.asarray(pieces, dtype=np.int64).reshape(-1, 2), out)
        else:
            out = _numpy_partial_dots(a, b, pieces, self._block_scratch("wide64", np.float64))
        return extend_range(out, a, b, pieces) if dtype_of(a) == np.float64 else out

    def scaled_add(self, a, b, pieces, ca, cb, dst=None, *, s):
        dst = a if dst is None else dst
        if self._compiled(s, dst, a, b):
            _c_kernels.scaled_add(dst, a, b, np.asarray(pieces, dtype=np.int64).reshape(-1, 2),
                                  np.ascontiguousarray(ca, dtype=np.float64),
                                  np.ascontiguousarray(cb, dtype=np.float64))
            return
        if dst is b:
            a, b = b, a  # compute into b's memory: the sum is symmetric in its two terms
            ca, cb = cb, ca
        wide = a.dtype != np.float64
        _numpy_scaled_add(a, b, pieces, ca, cb, self._block_scratch("wide64", np.float64) if wide else None,
                          "bfloat16" if a.dtype == np.uint16 else None)
        if dst is not a:
            dst[...] = a

    def pair(self, left, right, dst, pieces, span_array, count_left, count_right, *, s):
        if self._compiled(s, left, right, dst):
            _c_kernels.pair(left, right, dst, span_array, count_left, count_right)
            return
        super().pair(left, right, dst, pieces, span_array, count_left, count_right, s=s)

    def direct_parts(self, tensors, dtype, contiguous=False, *, s):
        if not use_c(s) or dtype not in _DIRECT_DTYPES:
            return None
        if not contiguous and not all(t.flags.c_contiguous for t in tensors):
            return None
        return list(tensors)

    def divide(self, buf, divisor):
        divide_in_place(buf, divisor)

    def host_typed(self, buf):
        return buf

    def mpi_bytes(self, buf):
        return buf.view(np.uint8)

    def to_host(self, buf, host):
        host[...] = buf.view(np.uint8)

    def from_host(self, host, buf):
        buf.view(np.uint8)[...] = host



# Element types of the compiled kernels (numpy's type characters): float32, float64, float16, and uint16,
# the bits of bfloat16 (only torch's bfloat16 tensors reach the kernels as uint16).
_KERNEL_TYPES = "fdeH"
_DIRECT_DTYPES = ("float32", "float64", *SIXTEEN)


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
            x, y = widen(a[bs:be], m[0]), widen(b[bs:be], m[1])
        if cuts is not None:
            i1 = i0 + len(cuts)
            out[i0:i1, 0] += np.add.reduceat(x * y, cuts)
            out[i0:i1, 1] += np.add.reduceat(x * x, cuts)
            out[i0:i1, 2] += np.add.reduceat(y * y, cuts)
        else:
            out[i0] += (np.dot(x, y), np.dot(x, x), np.dot(y, y))


def _numpy_scaled_add(a, b, pieces, ca, cb, wide_scratch, bits_of=None) -> None:
    """``a ← ca·a + cb·b`` per piece, computed in float64 block by block (in ``wide_scratch`` for narrower
    types; None: float64 data) and rounded once to the type, as the compiled kernel does. ``bits_of``:
    the dtype whose bits a uint16 ``a`` holds (bfloat16)."""
    wide = wide_scratch is not None
    for bs, be, i0, cuts in _numpy_blocks(len(a), pieces):
        if wide:
            x, y = wide_scratch[0, :be - bs], wide_scratch[1, :be - bs]
            widen(a[bs:be], x)
            widen(b[bs:be], y)
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
        if bits_of is not None:
            narrow(x, bits_of, out=a[bs:be])
        elif wide:
            with np.errstate(over="ignore"):
                a[bs:be] = x


def divide_in_place(buf: np.ndarray, divisor: int) -> None:
    """``buf /= divisor`` in ``buf``'s float dtype, bitwise as ``np.divide`` rounds it: by a power of two as
    a product with its reciprocal (exact, so the same correctly rounded value, at a multiplication's cost),
    otherwise as the division."""
    if divisor & (divisor - 1) == 0:
        np.multiply(buf, buf.dtype.type(1.0 / divisor), out=buf)
    else:
        np.divide(buf, buf.dtype.type(divisor), out=buf)
