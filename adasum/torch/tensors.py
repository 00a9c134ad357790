"""The arithmetic the training layer does on lists of tensors, each written once: averaging a window's
gradients, the non-finite check and mark, and the window's starting values (:class:`StartCopy`)."""

from __future__ import annotations

import torch

__all__ = ["StartCopy", "all_finite", "average_", "grads_of", "mark_nonfinite"]


def grads_of(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of ``params`` that exist."""
    return [p.grad for p in params if p.grad is not None]


def average_(grads: list[torch.Tensor], count: int, scale: float) -> None:
    """Divide, in place, the gradients a window of ``count`` micro-batches summed under loss scale
    ``scale``: one division by ``count·scale`` (with a power-of-two scale, it rounds exactly as a division
    by ``count`` alone)."""
    divisor = float(count) * scale
    if divisor != 1.0 and grads:
        torch._foreach_div_(grads, divisor)


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite: torch's fused check of GradScaler, one pass and one
    host synchronisation per device. It multiplies by 1.0 on the way, which changes no value."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_device.setdefault(t.device, []).append(t)
    for device, ts in by_device.items():
        # Made per call: the communication thread checks its buckets meanwhile.
        found, one = torch.zeros(1, device=device), torch.ones(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(ts, found, one)
        if found.item():
            return False
    return True


def mark_nonfinite(tensors: list[torch.Tensor]) -> None:
    """Put a NaN into the first non-empty tensor: a reduction that carries it makes every rank see a
    non-finite result, and so skip the update."""
    for t in tensors:
        if t.numel():
            t.view(-1)[0] = float("nan")
            return


class StartCopy:
    """The parameters' values at the start of the closing window, for ``op="adasum"``: the local step's
    delta is taken against them, and the parameters are set back to them when an update is skipped.

    ``where="device"`` keeps them next to the parameters (one more copy of the parameters in their memory);
    ``"host"`` keeps them in host memory (page-locked for CUDA parameters), and works one parameter at a
    time on the device. Buffers are made on first use and kept while the parameters keep their shapes.
    With overlap, the deltas of a window are kept apart from the parameters until ``step()``
    (:meth:`side`), next to the parameters.
    """

    def __init__(self, where: str):
        if where not in ("device", "host"):
            raise ValueError(f"start_copy must be 'device' or 'host', got {where!r}")
        self.where = where
        self._start: list[torch.Tensor] = []
        self._side: list[torch.Tensor | None] = []

    def ensure(self, params: list[torch.Tensor]) -> None:
        """Make the buffers for ``params`` (every trained parameter, in order) unless they fit already."""
        host = self.where == "host"
        if len(self._start) != len(params) or any(
                s.shape != p.shape or s.dtype != p.dtype or (not host and s.device != p.device)
                for s, p in zip(self._start, params)):
            self._start = [_host_like(p) if host else torch.empty_like(p) for p in params]
            self._side = [None] * len(params)

    def keep(self, index: list[int], params: list[torch.Tensor]) -> None:
        """Copy ``params`` (the parameters at positions ``index``) into their start buffers."""
        start = [self._start[i] for i in index]
        with torch.no_grad():
            if self.where == "host":
                for s, p in zip(start, params):
                    s.copy_(p.detach(), non_blocking=True)
            elif start:
                torch._foreach_copy_(start, [p.detach() for p in params])

    def apply(self, targets: list[torch.Tensor], index: list[int], how: str) -> None:
        """``target -= start`` ("sub"), ``target += start`` ("add") or ``target = start`` ("copy"), in place,
        for the parameters at positions ``index``."""
        start = [self._start[i] for i in index]
        if not targets:
            return
        with torch.no_grad():
            if self.where == "device":
                {"sub": torch._foreach_sub_, "add": torch._foreach_add_, "copy": torch._foreach_copy_}[how](
                    targets, start)
                return
            for t, s in zip(targets, start):
                s = s.to(t.device, non_blocking=True)  # one parameter's worth of device memory at a time
                if how == "sub":
                    t.sub_(s)
                elif how == "add":
                    t.add_(s)
                else:
                    t.copy_(s)

    def side(self, index: list[int], params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Kept buffers shaped as ``params`` (the parameters at positions ``index``), next to them."""
        out = []
        for i, p in zip(index, params):
            buf = self._side[i]
            if buf is None:
                buf = self._side[i] = torch.empty_like(p, memory_format=torch.contiguous_format)
            out.append(buf)
        return out


def _host_like(p: torch.Tensor) -> torch.Tensor:
    """An empty host tensor for ``p``'s values, page-locked where ``p`` is on a GPU."""
    return torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=p.device.type == "cuda")
