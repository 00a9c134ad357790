"""cupy arrays on a CUDA device (and the tests' numpy-backed stand-in of cupy)."""

from __future__ import annotations

import sys

import numpy as np

from ..kernels import segmented as _segmented
from ..rule.combine import extend_range
from .base import DEVICE_BLOCK, DeviceCopyStream, _blocks, per_layer_dots
from .host import _NumpyLike


class CupyAdapter(_NumpyLike):
    """cupy arrays on a CUDA device; the arithmetic runs in cupy kernels on that device.

    Written against the numpy-compatible subset of cupy's API plus ``xp.cuda`` (devices and streams),
    ``ndarray.get``/``ndarray.set`` and a page-locked host allocator, so that the tests can run it on a
    numpy-backed stand-in module where no GPU exists.
    """

    kind = "cupy"

    def __init__(self, xp):
        self.xp = xp
        self._scratch: dict = {}
        self._segmented: _segmented.SegmentedKernels | None = None

    def clear(self) -> None:
        self._scratch.clear()
        if self._segmented is not None:
            self._segmented.clear()

    def _torch_views(self, s, *operands):
        """Zero-copy torch views (DLPack) of flat cupy buffers where they take the segmented Triton
        kernels under the setting ``device_kernels``, else None (the per-layer cupy kernels)."""
        setting = s.device_kernels
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

    def partial_dots(self, a, b, pieces, *, s):
        views = self._torch_views(s, a, b)
        if views is not None:
            out = self._segmented.dots(*views, pieces)
            return extend_range(out, *views, pieces) if a.dtype == self.xp.float64 else out
        xp = self.xp
        out = xp.zeros((len(pieces), 3), dtype=xp.float64)
        native = a.dtype == xp.float64
        wide = None if native else (self._wide(a, 0, "float64"), self._wide(a, 1, "float64"))
        per_layer_dots(out, a, b, pieces, DEVICE_BLOCK, xp.dot, wide)
        out = xp.asnumpy(out)
        return extend_range(out, a, b, pieces) if native else out

    def scaled_add(self, a, b, pieces, ca, cb, dst=None, *, s):
        views = self._torch_views(s, a, b, a if dst is None else dst)
        if views is not None:
            self._segmented.combine(*views, pieces, ca, cb)
            return
        if dst is not None and dst is not a:
            self.scaled_add(a, b, pieces, ca, cb, s=s)
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
        xp = self.xp
        with self._on(device):
            stream = xp.cuda.Stream(non_blocking=True)

        def follow(side, events):  # the side stream waits for the work queued on the device so far
            ready = events.take()
            with self._on(device):
                ready.record(xp.cuda.get_current_stream())
            side.wait_event(ready)

        return DeviceCopyStream(self, stream, xp.cuda.Event, follow,
                                lambda side, buf, host: buf.get(stream=side, out=host, blocking=False),
                                lambda side, host, buf: buf.set(host, stream=side))
