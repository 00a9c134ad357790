"""The public call: ``adasum_allreduce`` and its in-place variant.

A call: parse the tensors and the op, look up (or make) the plan of these shapes and dtypes in the
communicator's context, decide where each group's data is reduced (its :class:`~adasum.fusion.Operand`),
agree with the other ranks in one small collective, run the schedule, and finish (write back, or return
views of the result).
"""

from __future__ import annotations

import enum
from typing import Any, Sequence

import numpy as np
from mpi4py import MPI

from . import settings as _settings
from . import stall
from .arrays import array_kind
from .context import Context, context_for
from .doubling import SmallCall, adasum_reduce_doubling
from .kernels import mpi_bound, use_isa
from .fusion import Group, Operand, TensorLayout, layer_spans, make_groups
from .launch import check_launch
from .transport import Transport, transport_for
from .validate import agree, describe, explain, signature
from .vhdd import adasum_reduce

from .kernels import compiled as _kernels  # None where the install could not build them

__all__ = ["Op", "adasum_allreduce", "adasum_allreduce_inplace"]


class Op(str, enum.Enum):
    """The reductions: ``ADASUM`` (the tree of :mod:`adasum.tree`), ``SUM`` and ``MEAN`` (MPI's own allreduce)."""

    ADASUM = "adasum"
    SUM = "sum"
    MEAN = "mean"

    def __str__(self) -> str:
        return self.value


def adasum_allreduce(tensors, *, op: str | Op = "adasum", comm: MPI.Intracomm | None = None,
                     hierarchical: bool = False):
    """Reduce ``tensors`` over the ranks of ``comm``; every rank gets the identical result.

    Collective: every rank of ``comm`` must call it, with tensors of the same shapes and dtypes in the same
    order, and the same ``op``.

    Args:
        tensors: one array, or a sequence of arrays: numpy arrays, torch tensors (CPU or CUDA) or cupy
            arrays, of dtype float16, bfloat16 (torch), float32 or float64, and integers for ``op="sum"``.
            Each array is one layer: Adasum computes its coefficients per array.
        op: ``"adasum"``, ``"sum"`` or ``"mean"`` (or an :class:`Op`).
        comm: an mpi4py intracommunicator; default ``MPI.COMM_WORLD``.
        hierarchical: ``op="adasum"`` only: the mean over the ranks of each node, then Adasum across nodes.

    Returns:
        New arrays of the same kind, shape, dtype and device, in the input's order (one array in, one out).
        The inputs are not modified. The outputs of one call may share one underlying buffer.

    Raises:
        TypeError: on every rank, if some rank passes an unsupported array type or dtype.
        AdasumMismatchError: on every rank, if the ranks disagree on the op, the number of tensors, a shape
            or a dtype. The message names the first differing tensor and the ranks.
        RuntimeError: at once, if another thread of this rank has a call in flight on ``comm``.
        AdasumStallError: on every rank that waited, if some rank did not enter the call within the setting
            ``stall_timeout`` (default: no timeout; a warning names such ranks after ``stall_warning``).
    """
    return _allreduce(tensors, op, comm, hierarchical, inplace=False)


def adasum_allreduce_inplace(tensors, *, op: str | Op = "adasum", comm: MPI.Intracomm | None = None,
                             hierarchical: bool = False):
    """Like :func:`adasum_allreduce`, but writes the result into ``tensors`` and returns them.

    On an error nothing is written: all checks happen before any data moves.
    """
    return _allreduce(tensors, op, comm, hierarchical, inplace=True)


def _as_list(tensors) -> tuple[bool, list]:
    if type(tensors) is list:
        return False, tensors  # read only, never kept
    if array_kind(tensors) is not None:
        return True, [tensors]
    if isinstance(tensors, (list, tuple)):
        return False, list(tensors)
    if isinstance(tensors, (str, bytes, dict)) or not isinstance(tensors, Sequence):
        raise TypeError(f"tensors must be an array or a sequence of arrays, got {type(tensors).__name__}")
    return False, list(tensors)


def _parse_op(op) -> str:
    if op in _OP_NAMES and type(op) is str:
        return op
    try:
        return Op(op).value
    except ValueError:
        raise ValueError(f"op must be one of 'adasum', 'sum', 'mean', got {op!r}") from None


def _allreduce(tensors, op, comm, hierarchical: bool, inplace: bool):
    ctx = context_for(comm)
    if ctx.enter("adasum_allreduce_inplace" if inplace else "adasum_allreduce") % 64 == 0:
        stall.drain(ctx)
    try:
        s = ctx.settings  # the call's snapshot: nothing below reads the live settings
        use_isa(s.kernels_isa)
        extras = _extras(ctx, s)
        if op == "adasum" and not hierarchical and type(tensors) is list and ctx.size > 1:
            done, known = _small_adasum(ctx, s, tensors, inplace, extras)
            if done is not None:
                return done
        else:
            known = None
        return _general(ctx, s, extras, tensors, op, hierarchical, inplace, known)
    finally:
        ctx.leave()


def _general(ctx: Context, s: _settings.Settings, extras: dict, tensors, op, hierarchical: bool, inplace: bool,
             known):
    """Every call that :func:`_small_adasum` does not take. ``known``: the call's plan, where it was found."""
    check_launch()  # a job whose processes MPI does not see raises here, on the first call
    rank, size = ctx.rank, ctx.size
    opname, single, items, plan, groups, members, layouts, error = str(op), False, [], None, [], [], [], None
    try:
        single, items = _as_list(tensors)
        opname = _parse_op(op)
        if hierarchical and opname != "adasum":
            raise ValueError(f"hierarchical=True needs op 'adasum', got '{opname}'")
        extra = extras["hierarchical" if hierarchical else opname]
        plan = known if known is not None else _plan(ctx, items, opname, extra)
        groups = [Operand(g) for g in plan.groups]
        members = [items] if plan.one_group else [[items[i] for i in g.indices] for g in groups]
        if inplace:  # where the tensors lie decides how the result gets into them; read-only ones fail here
            layouts = [_layout(g.adapter.layout(mine, g.indices, rank)) for g, mine in zip(groups, members)]
    except Exception as exc:  # whatever this rank cannot take, every rank raises (after the agreement)
        error = exc if str(exc).startswith("rank ") else _on_rank(exc, rank)
        extra = (("hierarchical", bool(hierarchical)),)
        groups, members = [], []

    flat = opname == "adasum" and not hierarchical and size > 1
    halving = flat and plan is not None and plan.nbytes > s.small_message_limit(size)
    # Flat Adasum may use the caller's tensors directly: an in-place call on tensors that lie apart is
    # combined in them, so that nothing is written back at the end (doubling at any size, halving from
    # direct_min_bytes, where it also reads them without packing them first: see vhdd.adasum_reduce).
    direct = flat and s.gpu_transport != "staged"
    big = plan is not None and plan.nbytes >= s.direct_min_bytes
    for g, mine, where in zip(groups, members, layouts if inplace else [None] * len(groups)):
        if inplace and where in (TensorLayout.ADJACENT, None):
            view = g.adapter.fused_view(mine, adjacent=where == TensorLayout.ADJACENT)
            if view is not None and len(view) == g.size:
                g.buffer, g.aliased = view, True
                continue
        if direct and g.size > 0 and (not inplace or where in (TensorLayout.APART, TensorLayout.ADJACENT)) \
                and (not halving or big):
            g.parts = g.adapter.direct_parts(mine, g.dtype, contiguous=where is not None)
        g.writes_parts = inplace and g.parts is not None
        g.packed = not (halving and g.parts is not None)
    # Halves sent straight from the caller's tensors go as one message per large layer piece (MPI's
    # fast path needs a contiguous send buffer): every rank must then cut its messages the same way.
    split = agree(ctx, opname, None if plan is None else plan.descs, error, extra=extra,
                  digest=None if plan is None else plan.signature,
                  vote=int(plan is not None and plan.nbytes >= s.split_min_bytes
                           and any(not g.packed for g in groups)))

    for g, mine in zip(groups, members):
        if g.aliased or (g.writes_parts and not g.packed):
            continue  # halving in the caller's tensors (in place) needs no fused buffer at all
        if inplace:
            g.buffer = ctx.buffers.get(ctx.adapters, g.adapter.kind, g.device, g.dtype, g.size, "fused")
        else:
            g.buffer = g.adapter.empty(g.size, g.dtype, g.device)
        if g.packed:
            g.adapter.pack(mine, g.buffer, g.bounds, g.spans)
    active = [g for g in groups if g.size > 0]

    if active and size > 1:
        if opname == "adasum" and hierarchical:
            from .hierarchical import hierarchical_reduce

            hierarchical_reduce(ctx, active)
        elif opname == "adasum":
            transports = plan.transports(ctx, active, s)
            if halving:
                adasum_reduce(ctx.lcomm, active, transports, split=s.chunk_bytes if split else 0)
            else:
                adasum_reduce_doubling(ctx.lcomm, active, transports)
        else:
            _plain_reduce(ctx, active, mean=opname == "mean")

    if inplace:
        for g, mine in zip(groups, members):
            if g.writes_parts or (g.aliased and size > 1):
                g.adapter.wrote_parts(mine)  # written through other views of their memory
            elif g.size > 0 and not g.aliased:
                g.adapter.write_back(mine, g.buffer, g.bounds, g.spans)
        return tensors
    out: list[Any] = [None] * len(items)
    for g in groups:
        for i, view in zip(g.indices, g.adapter.views(g.buffer, g.bounds, g.shapes)):
            out[i] = view
    return out[0] if single else out


def _on_rank(exc: Exception, rank: int) -> Exception:
    """``exc`` with its text starting with the rank that raised it."""
    try:
        return type(exc)(f"rank {rank}: {exc}")
    except Exception:  # an exception type that takes other arguments
        return RuntimeError(f"rank {rank}: {type(exc).__name__}: {exc}")


def _layout(where: int | None) -> TensorLayout | None:
    return None if where is None else TensorLayout(where)


def _small_adasum(ctx: Context, s: _settings.Settings, items: list, inplace: bool, extras: dict):
    """Adasum of a doubling call on contiguous float32/float64 host arrays (numpy, or torch CPU tensors
    through numpy views of their memory) as one compiled call (:class:`~adasum.doubling.SmallCall`): the
    same collective, messages and kernels as the general path, so ranks may take either. Returns
    ``(result, plan)``: the result None when the call is not one of those (or some check fails: the general
    path then reports it), with the call's kept plan if it found one."""
    if s.gpu_transport == "staged" or _kernels is None or s.kernels != "c" or not (s.native_mpi and mpi_bound()):
        return None, None
    try:
        plan = ctx.plans.get(_plan_key(items, "adasum", extras["adasum"]))
    except (AttributeError, TypeError, RuntimeError):  # the general path describes what is wrong
        return None, None
    if plan is None or plan.small is None or plan.small.program is None or plan.nbytes > extras["small limit"]:
        return None, plan
    call = plan.small
    live = call.live(items)
    g = call.group
    host = live if g.adapter.kind == "numpy" else g.adapter.host_views(live)  # torch: the same memory
    try:
        where = _kernels.layout(host, inplace)  # contiguous (and writable, in place), or it raises
    except (BufferError, ValueError):
        return None, plan
    if where == TensorLayout.OVERLAPPING:
        return None, plan  # the general path writes each result back in turn
    out = None if inplace else g.adapter.empty(g.size, g.dtype, g.device)
    dst = host if inplace else out if type(out) is np.ndarray else out.numpy()
    rc = call(host, dst, plan.signature, plan.descs, extras["patience"])
    if rc == -1:
        raise explain(ctx.lcomm, "adasum", plan.descs, None, extras["adasum"])
    if rc:
        raise MPI.Exception(rc)
    if inplace:
        if host is not live:
            g.adapter.wrote_parts(items)
        return items, plan
    return g.adapter.views(out, g.bounds, g.shapes), plan


def _extras(ctx: Context, s: _settings.Settings) -> dict:
    """What the ranks must agree on besides the tensors, per kind of call (part of the digest), for the
    settings ``s``; kept on the context while the settings stay the same."""
    kept = ctx.extras
    if kept is None or kept[0] is not s:
        agreed = s.agreed()
        adasum = (("hierarchical", False), *agreed)
        extras = {"adasum": adasum, "hierarchical": (("hierarchical", True), *agreed),
                  "sum": (("hierarchical", False),), "mean": (("hierarchical", False),),
                  # and what these settings make of this communicator's calls
                  "patience": stall.patience(s), "small limit": s.small_message_limit(ctx.size)}
        kept = ctx.extras = (s, extras)
    return kept[1]


_OP_NAMES = frozenset(o.value for o in Op)
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


class _Plan:
    """What a call's tensors and settings determine: descriptions, the agreement signature, the groups
    and their layer tables. Kept in the communicator's context for calls with the same shapes, dtypes and
    devices (a training loop's every step). A plan holds no buffers: what one call holds lives in its
    operands."""

    __slots__ = ("descs", "signature", "nbytes", "one_group", "groups", "small", "_transports")

    def __init__(self, ctx: Context, items, op: str, extra: tuple):
        adapters, self.descs = describe(items, op, ctx.rank, ctx.adapters)
        self.signature = signature(op, self.descs, extra)
        self.groups: list[Group] = make_groups(items, adapters, self.descs)
        for g in self.groups:
            layer_spans(g)
        self.nbytes = sum(g.size * (_ITEMSIZE.get(g.dtype) or np.dtype(g.dtype).itemsize) for g in self.groups)
        # one group holding every tensor in order: the call's list is the group's members
        self.one_group = len(self.groups) == 1 and self.groups[0].indices == list(range(len(items)))
        active = [g for g in self.groups if g.size > 0]
        # the compiled small call, where the call may take it
        self.small = None
        if (op == "adasum" and self.one_group and ctx.size > 1 and _kernels is not None
                and len(active) == 1 and active[0].dtype in ("float32", "float64")
                and (active[0].adapter.kind, active[0].device) in (("numpy", "cpu"), ("torch", "cpu"))):
            g = active[0]
            spans = layer_spans(g)
            self.small = SmallCall(ctx, g, spans[0], spans[2], len(items))
        self._transports: tuple = (None, [])

    def transports(self, ctx: Context, operands: Sequence[Operand], s: _settings.Settings) -> list[Transport]:
        """One :class:`Transport` per operand, kept while the settings stay the same (whether a group is
        staged depends on those and on its device only)."""
        if self._transports[0] is s and len(self._transports[1]) == len(operands):
            return self._transports[1]
        out = [_transport_for(ctx, g) for g in operands]
        self._transports = (s, out)
        return out


def _plan_key(items, op: str, extra: tuple) -> tuple:
    if _kernels is not None:
        return op, extra, _kernels.key(items)
    return op, extra, tuple([(type(t), t.shape, t.dtype, getattr(t, "device", None)) for t in items])


def _plan(ctx: Context, items, op: str, extra: tuple) -> _Plan:
    try:
        key = _plan_key(items, op, extra)
    except (AttributeError, TypeError, RuntimeError):  # not an array, unhashable, or without a shape
        # (a nested tensor): describe() says what is wrong
        return _Plan(ctx, items, op, extra)
    return ctx.plan(key, lambda: _Plan(ctx, items, op, extra))


def _transport_for(ctx: Context, g: Operand) -> Transport:
    # combined in the caller's tensors (buffer None): host memory, direct_parts gives no other
    return transport_for(ctx, ctx.lcomm, g.adapter, g.device, g.buffer)


def _plain_reduce(ctx: Context, groups: Sequence[Operand], mean: bool) -> None:
    """``sum`` and ``mean``: MPI's allreduce on each fused buffer; 16-bit floats travel as float32."""
    size = ctx.size
    for g in groups:
        t = _transport_for(ctx, g)
        if g.dtype in ("float16", "bfloat16"):
            wide = g.adapter.astype(g.buffer, "float32")
            t.allreduce_sum(wide)
            if mean:
                g.adapter.divide(wide, size)
            g.adapter.copy_(g.buffer, wide)
        else:
            t.allreduce_sum(g.buffer)
            if mean:
                g.adapter.divide(g.buffer, size)
