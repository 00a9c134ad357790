"""Device buffers that MPI cannot take: one round trip through page-locked host memory per call.

Where device buffers are staged (MPI is not CUDA-aware, or the setting ``gpu_transport="staged"``), the
cheapest call is what a user would write by hand: copy every tensor into page-locked host memory, reduce
there with the host call, copy the results back. Staging inside the schedules instead copies each level's
halves in chunks, with a wait per chunk, and runs the combine as device kernels per layer: many more copies,
synchronisations and Python calls for the same bytes. So a staged call is exactly that round trip: the
copies to the host are queued on the adapter's side stream (:class:`adasum.adapters.CopyStream`) and waited
for once, the host call (sum, mean, Adasum, hierarchical) runs on host views of the copies, in place, and
the copies back are queued and waited for once.

The host call computes Adasum with the host kernels, as on ranks that pass host tensors; only the setting
``device_kernels="triton"`` keeps the computation on the device (the general path, staged per level).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from ..runtime.gpu import use_staging
from ..runtime.scratch import Scratch

__all__ = ["round_trip"]

_ALIGN = 64  # each tensor's host copy starts on a cache line
_STAGE = 2   # the staging slot of the round trip (0 and 1 are the schedules' send and receive)


def round_trip(call, items: list, inplace: bool, host_call):
    """Reduce device tensors ``items`` (a list) through host memory, or return None (before anything moves)
    where they are not all contiguous device tensors of one kind and device that this call stages.
    ``host_call(call, host_items)`` reduces the host copies in place."""
    adapter = _staged_adapter(call, items)
    if adapter is None:
        return None
    device = adapter.device(items[0])
    first = items[0].dtype
    if len(items) > 1 and all(t.dtype == first for t in items):
        return _fused(call, adapter, device, adapter.dtype_name(items[0]), items, inplace, host_call)
    flats = [t.reshape(-1) for t in items]
    sizes = [int(t.shape[0]) * int(t.dtype.itemsize) for t in flats]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // _ALIGN) * _ALIGN
    pieces = [_stage(call, adapter, device, total)[lo:lo + n] for lo, n in zip(offsets, sizes)]
    copies = adapter.copy_stream(device)
    _to_host(copies, [(adapter.byte_view(t), piece) for t, piece in zip(flats, pieces) if len(piece)])
    call.record("copied_bytes", 2 * total)
    host_call(call._replace(settings=_on_host_settings(call.settings)),
              [_host_view(adapter, piece, t) for t, piece in zip(items, pieces)])
    outs = items if inplace else [adapter.empty(t.shape[0], adapter.dtype_name(t), device) for t in flats]
    for out, piece in zip(outs, pieces):
        if len(piece):
            copies.from_host(piece, adapter.byte_view(out.reshape(-1)))
    copies.end()
    if inplace:
        return items
    return [out.reshape(t.shape) for out, t in zip(outs, items)]


def _fused(call, adapter, device: str, dtype: str, items: list, inplace: bool, host_call):
    """The round trip of tensors of one dtype: packed on the device into one buffer (one device copy per
    tensor, queued), one copy to the host and one back, unpacked on the device."""
    bounds = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum([math.prod(t.shape) for t in items], out=bounds[1:])
    n = int(bounds[-1])
    buf = call.ctx.buffers.get(adapter.kind, device, dtype, n, "round trip") if inplace \
        else adapter.empty(n, dtype, device)
    adapter.pack(items, buf, bounds)
    raw = adapter.byte_view(buf)
    host = _stage(call, adapter, device, int(raw.shape[0]))
    copies = adapter.copy_stream(device)
    _to_host(copies, [(raw, host)] if len(host) else [])
    call.record("copied_bytes", 2 * len(host))
    flat = _host_view(adapter, host, buf)
    host_call(call._replace(settings=_on_host_settings(call.settings)),
              [flat[lo:hi].reshape(t.shape) for t, lo, hi in zip(items, bounds[:-1].tolist(), bounds[1:].tolist())])
    if len(host):
        copies.from_host(host, raw)
    copies.end()
    if inplace:
        adapter.write_back(items, buf, bounds)
        return items
    return adapter.views(buf, bounds, [t.shape for t in items])


def _stage(call, adapter, device: str, nbytes: int) -> np.ndarray:
    return Scratch(call.ctx.buffers, adapter.kind, device).stage(_STAGE, nbytes)


def _to_host(copies, pairs: list) -> None:
    """Queue the copies ``(device bytes, host bytes)`` on the side stream, after the work queued so far,
    and wait once for the last (the side stream runs them in order)."""
    copies.begin()
    mark = None
    for dev, host in pairs:
        mark = copies.to_host(dev, host)
    if mark is not None:
        copies.wait(mark)


@functools.lru_cache(maxsize=4)
def _on_host_settings(s):
    """The settings of the host call: its host copies go to MPI as they are (``gpu_transport="staged"``
    would stage them once more)."""
    return s if s.gpu_transport != "staged" else dataclasses.replace(s, gpu_transport="auto")


def _staged_adapter(call, items: list):
    """The adapter of ``items`` where they are contiguous device tensors of one type and device whose
    exchanges this call would stage, else None."""
    s = call.settings
    if not items or s.device_kernels == "triton":
        return None
    first = items[0]
    adapter = call.ctx.adapters.for_array(first)
    if adapter is None or adapter.kind not in ("torch", "cupy"):
        return None
    try:
        if adapter.is_host(first) or not use_staging(s, adapter, first):
            return None
        device, kind = adapter.device(first), type(first)
        for t in items:
            if type(t) is not kind or adapter.device(t) != device or not _contiguous(t) or \
                    (adapter.kind == "torch" and adapter.refusal(t) is not None):
                return None
    except (AttributeError, TypeError, RuntimeError):
        return None
    return adapter


def _contiguous(t) -> bool:
    test = getattr(t, "is_contiguous", None)
    return test() if test is not None else bool(t.flags.c_contiguous)


def _host_view(adapter, host_bytes, t):
    """The host copy of ``t`` as an array the host call takes: numpy for cupy, a CPU tensor for torch (whose
    bfloat16 numpy does not have)."""
    if adapter.kind == "torch":
        torch = adapter.torch
        return torch.from_numpy(host_bytes).view(t.dtype).view(t.shape)
    return host_bytes.view(np.dtype(adapter.dtype_name(t))).reshape(t.shape)
