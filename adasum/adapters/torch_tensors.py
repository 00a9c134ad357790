"""torch tensors on the CPU (computed on numpy views of their memory) or a CUDA device."""

from __future__ import annotations

import weakref

import numpy as np

from ..kernels import segmented as _segmented
from ..rule.combine import extend_range
from .base import BLOCK, DEVICE_BLOCK, _KEPT_VIEWS, Adapter, CopyStream, DeviceCopyStream, _blocks, _host, per_layer_dots
from .host import NumpyAdapter


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

    def _segmented_for(self, s, *operands) -> _segmented.SegmentedKernels | None:
        """The segmented Triton kernels where flat tensor ``operands`` take them under the setting
        ``device_kernels`` of ``s``, else None (lists of host pieces never do)."""
        setting = s.device_kernels
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

    def _host_pair(self, tensors, buf, spans):
        """numpy views of CPU tensors and of a CPU buffer for the numpy adapter's compiled copies (a view or
        a copy per tensor in torch costs microseconds each), else None."""
        if spans is None or buf.device.type != "cpu":
            return None
        views = self._host_views(tensors)
        return None if views is None else (views, _host(buf))

    def pack(self, tensors, buf, bounds, spans=None):
        pair = self._host_pair(tensors, buf, spans)
        if pair is not None:
            self._numpy.pack(pair[0], pair[1], bounds, spans)
            return
        with self.torch.no_grad():
            for t, s, e in zip(tensors, bounds[:-1], bounds[1:]):
                buf[s:e].view(t.shape).copy_(t)

    def views(self, buf, bounds, shapes):
        return [buf[s:e].view(shape) for s, e, shape in zip(bounds[:-1], bounds[1:], shapes)]

    def write_back(self, tensors, buf, bounds, spans=None):
        pair = self._host_pair(tensors, buf, spans)
        if pair is not None:
            self._numpy.write_back(pair[0], pair[1], bounds, spans)
            self.wrote_parts(tensors)  # as torch's copy_ would: autograd sees them modified in place
            return
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
        """Whether an operand is computed on by the numpy adapter (and so by the compiled kernels): host
        memory, bfloat16 as its uint16 bits (lists are flat numpy views of the caller's CPU tensors, from
        :meth:`direct_parts`)."""
        return type(x) is list or x.device.type == "cpu"

    def layout(self, tensors, indices, rank):
        views = self._host_views(tensors)
        return None if views is None else self._numpy.layout(views, indices, rank)

    def direct_parts(self, tensors, dtype, contiguous=False, *, s):
        if not contiguous and not all(t.is_contiguous() for t in tensors):
            return None
        views = self._host_views(tensors)
        return None if views is None else self._numpy.direct_parts(views, dtype, contiguous=True, s=s)

    def _host_views(self, tensors):
        """numpy views of CPU float tensors (their own memory; bfloat16 as its uint16 bits), else None."""
        torch = self.torch
        if not tensors or tensors[0].device.type != "cpu" or tensors[0].dtype not in (
                torch.float32, torch.float64, torch.float16, torch.bfloat16):
            return None
        if any(map(torch.Tensor.is_neg, tensors)):  # a negated view (x.conj().imag): its memory holds -x,
            return None  # so it goes through torch's own copies, which read and write it as -x
        return self.host_views(tensors)

    def addresses(self, tensors) -> tuple | None:
        """The addresses of contiguous CPU tensors, for the compiled small calls (a fraction of what numpy
        views of them cost; torch's memory is always writable), else None: a tensor that is not contiguous,
        a negated view (``x.conj().imag``: its memory holds -x, so only torch's own copies read it as its
        values) or one without memory of its own (sparse), which the general path takes or names."""
        tensor = self.torch.Tensor
        try:
            if not all(map(tensor.is_contiguous, tensors)) or any(map(tensor.is_neg, tensors)):
                return None
            return tuple(map(tensor.data_ptr, tensors))
        except RuntimeError:
            return None

    def host_views(self, tensors) -> list:
        """numpy views of the memory of CPU tensors of one dtype, kept while the same tensor objects come
        back with the same memory, shape and contiguity: making them costs microseconds per tensor, as
        much as the rest of a small call. Views of a few lists are kept, for loops that reduce several;
        a list's views are dropped as soon as one of its tensors is freed."""
        key = id(tensors[0]) if tensors else 0
        kept = self._views.get(key)
        tensor = self.torch.Tensor
        # The checks as C-level maps: a Python loop over the tensors cost as much as the rest of a small call.
        # While an entry is kept its tensors are alive (a freed one drops it), so equal ids are the same objects.
        if kept is not None and tuple(map(id, tensors)) == kept[1] and \
                tuple(map(tensor.data_ptr, tensors)) == kept[2] and all(map(tensor.is_contiguous, tensors)) and \
                tuple(map(tensor.size, tensors)) == kept[3]:
            return kept[4]
        views = [_host(t.detach()) for t in tensors]
        # [weak references, ids, addresses, shapes, views]
        entry = [None, tuple(map(id, tensors)), tuple(t.data_ptr() for t in tensors),
                 tuple(t.shape for t in tensors), views]

        def forget(_, key=key):  # a tensor is gone: its views must not keep its memory alive
            if self._views.get(key) is entry:
                del self._views[key]

        try:
            entry[0] = [weakref.ref(t, forget) for t in tensors]
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

    def partial_dots(self, a, b, pieces, *, s):
        torch = self.torch
        fast = self._segmented_for(s, a, b)
        if fast is not None:
            out = fast.dots(a, b, pieces)
            return extend_range(out, a, b, pieces) if a.dtype == torch.float64 else out
        if self._numpy_path(a):
            # numpy's kernels, on the same memory: they vectorise over many small layers
            return self._numpy.partial_dots(_host(a), _host(b), pieces, s=s)
        out = torch.zeros((len(pieces), 3), dtype=torch.float64, device=a.device)
        native = a.dtype == torch.float64
        wide = None if native else (self._wide(a, 0, torch.float64), self._wide(a, 1, torch.float64))
        per_layer_dots(out, a, b, pieces, self._block(a), torch.dot, wide)
        out = out.cpu().numpy()
        return extend_range(out, a, b, pieces) if native else out

    def pair(self, left, right, dst, pieces, span_array, count_left, count_right, *, s):
        if self._numpy_path(left) and self._segmented_for(s, left, right, dst) is None:
            self._numpy.pair(_host(left), _host(right), _host(dst), pieces, span_array, count_left, count_right, s=s)
            return
        super().pair(left, right, dst, pieces, span_array, count_left, count_right, s=s)

    def scaled_add(self, a, b, pieces, ca, cb, dst=None, *, s):
        torch = self.torch
        fast = self._segmented_for(s, a, b, a if dst is None else dst)
        if fast is not None:
            fast.combine(a, b, a if dst is None else dst, pieces, ca, cb)
            return
        if self._numpy_path(a):
            self._numpy.scaled_add(_host(a), _host(b), pieces, ca, cb, None if dst is None else _host(dst), s=s)
            return
        if dst is not None and dst is not a:
            self.scaled_add(a, b, pieces, ca, cb, s=s)
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
        if divisor & (divisor - 1) == 0:  # exact: the same correctly rounded value as the division
            buf.mul_(1.0 / divisor)
        else:
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
        if not device.startswith("cuda"):
            return CopyStream(self)
        torch, where = self.torch, self.torch.device(device)

        def to_host(side, buf, host):
            with torch.cuda.stream(side):
                torch.from_numpy(host).copy_(buf, non_blocking=True)

        def from_host(side, host, buf):
            with torch.cuda.stream(side):
                buf.copy_(torch.from_numpy(host), non_blocking=True)

        return DeviceCopyStream(self, torch.cuda.Stream(device=where), torch.cuda.Event,
                                lambda side, events: side.wait_stream(torch.cuda.current_stream(where)),
                                to_host, from_host)
