"""16-bit wire formats for ``DistributedOptimizer(compression=...)``: :class:`Wire` reduces a list of
tensors (weight deltas or gradients) over a communicator, travelling as their own dtype or as 16-bit floats.

float16 has five exponent bits: below 6e-8 everything is zero, and the deltas of fine-tuning rates (an
Adam step of lr 1e-8 moves a weight by about 1e-8) would vanish. So with ``"fp16"`` every layer is
multiplied, before the cast, by a power of two that every rank agrees on (from the largest magnitude of the
layer over all ranks, one small exchange per reduction): the layer's largest value lands near
``65504 / (2·P)``, which leaves room for the sums of P ranks. Powers of two scale exactly, and Adasum and the
sum are linear in a common factor, so the result is divided by the same power after the reduction. What
still overflows or underflows is logged once per layer. bfloat16 has float32's exponent range and is sent
unscaled.

The library reduces 16-bit buffers itself: Adasum sends them as they are and computes the dot products,
norms and the combine in float32 or wider; ``sum``/``mean`` send 16-bit blocks and add them in float32
(:meth:`adasum.runtime.collectives.Collectives.allreduce_16bit`). The tensors of a reduction are scaled, cast and packed
into one 16-bit buffer in one pass, and widened, unscaled and unpacked in one pass after it.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from mpi4py import MPI

from ...call.allreduce import adasum_allreduce_inplace, allreduce_inplace_with, allreduce_sharded_inplace
from ...runtime.agreement import Companion
from ...runtime import exchange
from ..internals import foreach_norm

__all__ = ["WIRE_DTYPES", "Wire", "wire_dtype"]

_log = logging.getLogger("adasum")
_FP16_MAX = 65504.0
_FP16_TINY = 2.0 ** -24  # the smallest positive float16 (subnormal)
_MAX_EXP = 126  # scales stay within float32's normal range: 2**-126 .. 2**126

WIRE_DTYPES = {None: None, "none": None, "fp16": torch.float16, "float16": torch.float16,
               "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def _reduce(tensors: list, op: str, comm: MPI.Intracomm, companion: Companion | None,
            hierarchical: bool = False, shard: MPI.Intracomm | None = None) -> None:
    """``op`` of ``tensors`` over ``comm``, in place, the companion (never with ``hierarchical``) on its
    agreement; ``shard`` (Adasum only): the tensors are pieces of layers whose other pieces the ranks of
    ``shard`` hold (:func:`~adasum.call.allreduce.allreduce_sharded_inplace`)."""
    if shard is not None and op == "adasum":
        allreduce_sharded_inplace(tensors, comm, shard)
    elif companion is None:
        adasum_allreduce_inplace(tensors, op=op, comm=comm, hierarchical=hierarchical)
    else:
        allreduce_inplace_with(tensors, op, comm, companion)


def wire_dtype(compression) -> torch.dtype | None:
    """The torch dtype that ``compression`` (None, "fp16", "bf16") sends, or None."""
    key = compression.lower() if isinstance(compression, str) else compression
    if key not in WIRE_DTYPES:
        raise ValueError(f"compression must be None, 'fp16' or 'bf16', got {compression!r}")
    return WIRE_DTYPES[key]


class Wire:
    """How a reduction travels: ``compression`` None (each tensor's own dtype), ``"fp16"`` or ``"bf16"``.

    :meth:`adasum_` and :meth:`sum_` reduce in place and return, per tensor, the largest magnitude over all
    ranks (None where nothing was scaled), which :meth:`explain` uses to tell an overflow of the wire from
    a non-finite input.
    """

    def __init__(self, compression=None):
        self.dtype = wire_dtype(compression)
        self.name = {None: None, torch.float16: "fp16", torch.bfloat16: "bf16"}[self.dtype]
        self._reported: set[tuple[int, str]] = set()
        self._kept = Kept()  # the 16-bit buffer: one reduction at a time runs on a wire

    def adasum_(self, tensors: list[torch.Tensor], comm: MPI.Intracomm, hierarchical: bool = False,
                names: list[str] | None = None, companion: Companion | None = None,
                shard: MPI.Intracomm | None = None):
        """Adasum of ``tensors`` (one layer each, named by ``names`` in what is logged) over ``comm``, in
        place. ``companion`` (where :attr:`carries_companion`, not hierarchical) rides on the reduction's
        agreement. ``shard``: each tensor is one piece of a layer whose other pieces the ranks of ``shard``
        hold (the replicas of a sharded model); the fp16 scales are then agreed over both groups."""
        if self.dtype is None:
            _reduce(tensors, "adasum", comm, companion, hierarchical, shard)
            return None
        scales, amax = self._scales(tensors, comm, names, shard)
        self._reduce16(tensors, scales, "adasum", comm, hierarchical, companion, shard)
        return amax

    @property
    def carries_companion(self) -> bool:
        """Whether :meth:`sum_` and :meth:`adasum_` start with the reduction's own agreement (no exchange of
        scales before it), which can then carry the caller's (a :class:`~adasum.runtime.agreement.Companion`)."""
        return self.dtype is not torch.float16

    def sum_(self, tensors: list[torch.Tensor], comm: MPI.Intracomm, mean: bool, names: list[str] | None = None,
             companion: Companion | None = None):
        """Sum (``mean``: mean) of ``tensors`` over ``comm``, in place. ``companion`` (where
        :attr:`carries_companion`) rides on the reduction's agreement."""
        op = "mean" if mean else "sum"
        if self.dtype is None:
            _reduce(tensors, op, comm, companion)
            return None
        scales, amax = self._scales(tensors, comm, names)
        self._reduce16(tensors, scales, op, comm, companion=companion)
        return amax

    def _reduce16(self, tensors: list[torch.Tensor], scales: list[float], op: str, comm: MPI.Intracomm,
                  hierarchical: bool = False, companion: Companion | None = None,
                  shard: MPI.Intracomm | None = None) -> None:
        """``op`` of ``tensors`` over ``comm``, in place, travelling as the wire's dtype: each tensor times its
        scale is cast into its view of one kept 16-bit buffer (one pass), the library reduces that buffer (the
        views as layers for Adasum), and each view divided by its scale goes back into its tensor's own dtype
        (one pass). Identical on every rank."""
        device = tensors[0].device if tensors else torch.device("cpu")
        flat = self._kept.get(sum(t.numel() for t in tensors), self.dtype, device)
        views = _views(flat, tensors)
        _pack(tensors, views, scales)
        if op == "adasum":
            _reduce(views, op, comm, companion, hierarchical, shard)
        else:  # a sum is element-wise: the buffer goes whole
            _reduce([flat], op, comm, companion)
        _unpack(views, tensors, scales)

    def explain(self, tensors: list[torch.Tensor], amax, names: list[str]) -> None:
        """After a reduction whose result is not finite: log, once per layer, each layer that the 16-bit
        wire overflowed although every rank's values were finite."""
        if amax is None:
            return
        for t, a, name in zip(tensors, amax, names):
            if math.isfinite(a) and t.numel() and not bool(torch.isfinite(t).all()):
                self._once(name, "overflow", f"adasum: {name} overflowed the {self.name} wire: the reduced "
                           f"values are not finite although every rank's largest magnitude was {a:.3g}; "
                           "the update is skipped (use compression='bf16' or None)")

    def _scales(self, tensors: list[torch.Tensor], comm: MPI.Intracomm, names: list[str] | None,
                shard: MPI.Intracomm | None = None) -> tuple[list[float], list[float]]:
        """Per tensor, the power of two it travels multiplied by, and its largest magnitude over all ranks
        (of ``comm``, and of ``shard`` where the tensors are pieces of layers cut across it)."""
        if self.dtype is not torch.float16:
            return [1.0] * len(tensors), None
        local = _largest_magnitudes(tensors)
        amax = exchange.max_of(comm, local, what="the fp16 wire's scales")
        if shard is not None and shard.Get_size() > 1:
            amax = exchange.max_of(shard, amax, what="the fp16 wire's scales")
        target = _FP16_MAX / (2 ** math.ceil(math.log2(2 * comm.Get_size())))
        scales = []
        for i, a in enumerate(amax):
            if not math.isfinite(a) or a == 0.0:
                scales.append(1.0)
                continue
            e = min(max(math.floor(math.log2(target / a)), -_MAX_EXP), _MAX_EXP)
            scales.append(2.0 ** e)
            if a * 2.0 ** e < _FP16_TINY:
                name = names[i] if names and i < len(names) else f"tensor {i} of the reduction"
                self._once(name, "underflow",
                           f"adasum: {name} underflows the fp16 wire: its largest magnitude over the ranks is "
                           f"{a:.3g}, below what a scale of 2**{_MAX_EXP} brings into float16's range; it "
                           "travels as zeros")
        return scales, [float(a) for a in amax]

    def _once(self, name: str, what: str, text: str) -> None:
        if (name, what) not in self._reported:
            self._reported.add((name, what))
            _log.warning(text)


def _largest_magnitudes(tensors: list[torch.Tensor]) -> np.ndarray:
    """Per tensor, its largest magnitude (0 for an empty one; NaN where it holds one), in float64: one fused
    pass and one copy to the host per device."""
    out = np.zeros(len(tensors))
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        norms = foreach_norm([tensors[i].detach() for i in idx], float("inf"))
        out[idx] = torch.stack([n.to(torch.float64) for n in norms]).cpu().numpy()
    return out


def _pack(tensors: list[torch.Tensor], views: list[torch.Tensor], scales: list[float] | None) -> None:
    """Each tensor times its scale, cast to the views' dtype, into its view: one pass (on the same device)."""
    with torch.no_grad():
        for t, v, s in zip(tensors, views, scales or [1.0] * len(tensors)):
            flat = t.detach().reshape(-1)
            if s == 1.0:
                v.copy_(flat)
            elif flat.device == v.device:
                torch.mul(flat, s, out=v)
            else:
                v.copy_(flat * s)


def _unpack(views: list[torch.Tensor], tensors: list[torch.Tensor], scales: list[float] | None) -> None:
    """Each view into its tensor, widened to the tensor's own dtype, then divided by its scale there (a
    division in 16 bits would underflow)."""
    with torch.no_grad():
        for t, v, s in zip(tensors, views, scales or [1.0] * len(tensors)):
            t.copy_(v.view(t.shape))
            if s != 1.0:
                t.div_(s)


class Kept:
    """The 16-bit wire's buffer, kept between calls and grown as needed (one per :class:`Wire`)."""

    def __init__(self):
        self._buf: torch.Tensor | None = None

    def get(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._buf
        if buf is None or buf.dtype != dtype or buf.device != device or buf.numel() < n:
            buf = self._buf = torch.empty(n, dtype=dtype, device=device)
        return buf[:n]


def _views(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    out, off = [], 0
    for t in tensors:
        out.append(flat[off:off + t.numel()])
        off += t.numel()
    return out


