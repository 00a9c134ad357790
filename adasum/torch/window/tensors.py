"""The arithmetic the training layer does on lists of tensors, each written once: averaging a window's
gradients, the non-finite check and mark, and the buffers adasum keeps per parameter (:class:`StartCopy`:
the window's starting values, the shadows)."""

from __future__ import annotations

import torch

from ...kernels.native import compiled as _COMPILED  # None where the kernels were not built
from ..internals import (foreach_add_, foreach_copy_, foreach_div_, foreach_sub_, non_finite_check_and_unscale_,
                         sparse_values)

__all__ = ["Snapshot", "StartCopy", "all_finite", "all_params", "average_", "grads_of", "mark_nonfinite",
           "trained_params"]


def grads_of(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of ``params`` that exist."""
    return [p.grad for p in params if p.grad is not None]


def average_(grads: list[torch.Tensor], count: int, scale: float) -> None:
    """Divide, in place, the gradients a window of ``count`` micro-batches summed under loss scale
    ``scale``: one division by ``count·scale`` (with a power-of-two scale, it rounds exactly as a division
    by ``count`` alone)."""
    divisor = float(count) * scale
    if divisor != 1.0 and grads:
        foreach_div_(grads, divisor)


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` (dense, or sparse COO: their values) is finite. Contiguous
    host tensors of a floating dtype are read once by the compiled kernels (their exponent bits), where
    those were built; the others go through torch's fused check of GradScaler, one pass and one host
    synchronisation per device, which multiplies by 1.0 on the way (changing no value)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    host: dict[torch.dtype, tuple[list[int], list[int]]] = {}
    for t in tensors:
        if t.is_sparse:  # a sparse gradient (nn.Embedding(sparse=True)): its stored values
            t = sparse_values(t)
        n = t.numel()
        if not n:
            continue
        if _COMPILED is not None and t.dtype in _EXPONENT and t.device.type == "cpu" and t.is_contiguous():
            where = host.setdefault(t.dtype, ([], []))
            where[0].append(t.data_ptr())
            where[1].append(n)
        else:
            by_device.setdefault(t.device, []).append(t)
    for dtype, (addresses, counts) in host.items():
        if not _COMPILED.finite(addresses, counts, *_EXPONENT[dtype]):
            return False
    for device, ts in by_device.items():
        # Made per call: the communication thread checks its buckets meanwhile.
        found, one = torch.zeros(1, device=device), torch.ones(1, device=device)
        non_finite_check_and_unscale_(ts, found, one)
        if found.item():
            return False
    return True


# Per floating dtype: its width in bytes and its exponent bits (all set: NaN or Inf).
_EXPONENT = {torch.float32: (4, 0x7F800000), torch.float64: (8, 0x7FF0000000000000),
             torch.float16: (2, 0x7C00), torch.bfloat16: (2, 0x7F80)}


def mark_nonfinite(tensors: list[torch.Tensor]) -> None:
    """Put a NaN into the first non-empty tensor: a reduction that carries it makes every rank see a
    non-finite result, and so skip the update."""
    for t in tensors:
        if t.numel():
            t.view(-1)[0] = float("nan")
            return


def apply_kept(where: str, targets: list[torch.Tensor], kept: list[torch.Tensor], how: str) -> None:
    """``target -= kept`` ("sub"), ``target += kept`` ("add") or ``target = kept`` ("copy"), in place; kept
    values on the host (``where="host"``) come to the device one parameter's worth at a time."""
    with torch.no_grad():
        if where == "device":
            {"sub": foreach_sub_, "add": foreach_add_, "copy": foreach_copy_}[how](targets, kept)
            return
        for t, s in zip(targets, kept):
            s = s.to(t.device, non_blocking=True)
            {"sub": t.sub_, "add": t.add_, "copy": t.copy_}[how](s)


class StartCopy:
    """The buffers ``op="adasum"`` keeps per parameter: the window's starting values, and the shadows.

    A boundary reduced in ``step()`` takes the local step in the parameters themselves: the start copy
    (:meth:`keep`) is what the delta is taken against and what the parameters are set back to when an
    update is skipped. ``where="device"`` keeps it next to the parameters (one more copy of the parameters
    in their memory); ``"host"`` keeps it in host memory (page-locked for CUDA parameters), and works one
    parameter at a time on the device.

    A bucket reduced apart from the parameters (overlap, the DDP delta hook) takes its local step on
    shadows (:meth:`side`): copies of the parameters, next to them, which then hold the deltas. The
    parameters are the start then, and no start copy is kept for them.

    Buffers are made on first use and kept while the parameters keep their shapes.
    """

    def __init__(self, where: str):
        if where not in ("device", "host"):
            raise ValueError(f"start_copy must be 'device' or 'host', got {where!r}")
        self.where = where
        self._start: list[torch.Tensor | None] = []
        self._side: list[torch.Tensor | None] = []
        self._shapes: list[tuple] = []

    def ensure(self, params: list[torch.Tensor]) -> None:
        """Forget the buffers unless they fit ``params`` (every trained parameter, in order)."""
        shapes = [(p.shape, p.dtype, p.device) for p in params]
        if shapes != self._shapes:
            self._shapes = shapes
            self._start = [None] * len(params)
            self._side = [None] * len(params)

    def keep(self, index: list[int], params: list[torch.Tensor]) -> None:
        """Copy ``params`` (the parameters at positions ``index``) into their start buffers."""
        host = self.where == "host"
        start = []
        for i, p in zip(index, params):
            s = self._start[i]
            if s is None:
                s = self._start[i] = _host_like(p) if host else torch.empty_like(p)
            start.append(s)
        with torch.no_grad():
            if host:
                for s, p in zip(start, params):
                    s.copy_(p.detach(), non_blocking=True)
            elif start:
                foreach_copy_(start, [p.detach() for p in params])

    def apply(self, targets: list[torch.Tensor], index: list[int], how: str) -> None:
        """``target -= start`` ("sub"), ``target += start`` ("add") or ``target = start`` ("copy"), in place,
        for the parameters at positions ``index``."""
        if targets:
            apply_kept(self.where, targets, [self._start[i] for i in index], how)

    def side(self, index: list[int], params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The kept shadows of ``params`` (the parameters at positions ``index``): same shape, dtype and
        device, contiguous. Their start copies, no longer needed, are freed."""
        out = []
        for i, p in zip(index, params):
            buf = self._side[i]
            if buf is None:
                buf = self._side[i] = torch.empty_like(p, memory_format=torch.contiguous_format)
            self._start[i] = None
            out.append(buf)
        return out


def _host_like(p: torch.Tensor) -> torch.Tensor:
    """An empty host tensor for ``p``'s values, page-locked where ``p`` is on a GPU."""
    return torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=p.device.type == "cuda")


class Snapshot:
    """Values kept per parameter, by identity (not position): a window's start, or ``delay=1``'s last
    common point. ``where="device"`` keeps them next to the parameters, ``"host"`` in host memory
    (page-locked for CUDA parameters). A buffer is made on first use and kept while its parameter keeps
    its shape, dtype and device; the parameter is held with it, so its identity is never reused."""

    def __init__(self, where: str):
        self.where = where
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (parameter, value)

    def __contains__(self, p: torch.Tensor) -> bool:
        return id(p) in self._kept

    def __len__(self) -> int:
        return len(self._kept)

    def params(self) -> list[torch.Tensor]:
        """The parameters with a kept value, in the order they were first kept."""
        return [p for p, _ in self._kept.values()]

    def keep(self, params: list[torch.Tensor], values: list[torch.Tensor] | None = None) -> None:
        """Keep ``values`` (default: the parameters' own) as the values of ``params``."""
        values = params if values is None else values
        with torch.no_grad():
            for p, v in zip(params, values):
                held = self._kept.get(id(p))
                buf = None if held is None else held[1]
                if buf is None or buf.shape != p.shape or buf.dtype != p.dtype or (
                        self.where == "device" and buf.device != p.device):
                    buf = _host_like(p) if self.where == "host" else torch.empty_like(
                        p, memory_format=torch.contiguous_format)
                    self._kept[id(p)] = (p, buf)
                buf.copy_(v.detach(), non_blocking=self.where == "host")

    def forget(self, params: list[torch.Tensor]) -> None:
        for p in params:
            self._kept.pop(id(p), None)

    def values(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The kept values of ``params`` (where they are kept)."""
        return [self._kept[id(p)][1] for p in params]

    def apply(self, targets: list[torch.Tensor], params: list[torch.Tensor], how: str) -> None:
        """``target -= kept`` ("sub"), ``target += kept`` ("add") or ``target = kept`` ("copy"), in place,
        with the kept values of ``params``."""
        if targets:
            apply_kept(self.where, targets, self.values(params), how)


def all_params(optimizer) -> list[torch.Tensor]:
    """Every parameter of ``optimizer``, trained or frozen, each once, in the order of its param groups."""
    return list({id(p): p for group in optimizer.param_groups for p in group["params"]}.values())


def trained_params(optimizer) -> list[torch.Tensor]:
    """The parameters of ``optimizer`` that train, each once, in the order of its param groups (the same on
    every rank)."""
    seen: set[int] = set()
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out
