"""The public call: ``adasum_allreduce`` and its in-place variant.

A call, hop by hop (docs/design.md, "The path of one call"): enter the communicator's context (which takes the settings
snapshot); take the compiled small call where the plan allows it; otherwise check the input locally, look up
(or make) the :class:`~adasum.call.plan.Plan` of these shapes, place each group's data
(:func:`~adasum.call.plan.place`) and pack it; agree with the other ranks in one small collective; run the plan's
schedule; finish (write back, or return views of the result).
"""

from __future__ import annotations

import enum
from typing import Any, Sequence

import numpy as np
from mpi4py import MPI

from ..runtime.agreement import Companion, agree
from .plain import FUSED_VOTE, run_plain
from .roundtrip import round_trip
from ..adapters import array_kind
from ..runtime.context import Call, Context, context_for
from ..schedules import small_call
from ..schedules.doubling import adasum_reduce_doubling
from ..schedules.fusion import Operand, Placement, TensorLayout
from ..schedules.halving import adasum_reduce, partials_summed_over
from ..schedules.hierarchical import hierarchical_reduce
from ..runtime.launch import check_launch
from ..kernels.native import use_isa
from .plan import Plan, Schedule, agreed_extras, kept_plan, place, plan_for
from ..runtime.collectives import Collectives
from ..runtime.transport import transport_for
from ..rule.dtypes import itemsize

__all__ = ["Op", "adasum_allreduce", "adasum_allreduce_inplace"]


class Op(str, enum.Enum):
    """The reductions: ``ADASUM`` (the tree of :mod:`adasum.rule.tree`), ``SUM`` and ``MEAN`` (MPI's own allreduce)."""

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


def allreduce_inplace_with(tensors, op: str, comm: MPI.Intracomm, companion: Companion):
    """:func:`adasum_allreduce_inplace` (not hierarchical) whose agreement also carries ``companion``: the
    caller's own agreement (:class:`~adasum.runtime.agreement.Companion`), so one small collective does for
    both. Where the companions differ or one has an error, every rank raises as in any other difference,
    before any data moves."""
    return _allreduce(tensors, op, comm, False, inplace=True, companion=companion)


def allreduce_sharded_inplace(tensors, comm: MPI.Intracomm, shard: MPI.Intracomm):
    """Adasum over ``comm``, in place, of tensors that are pieces of larger layers: each tensor is one
    layer's piece, and the ranks of ``shard`` (this rank among them) hold the other pieces of the same
    layers, in the same order, each reducing them over its own ``comm`` at the same time (the replicas of
    a sharded model: ``comm`` this rank's replicate group, ``shard`` its shard group). The dot products of
    every layer are summed over ``shard`` before the coefficients are taken, so the result is the Adasum
    of the whole layers, bitwise alike on every rank of ``shard``. Collective over both communicators."""
    return _allreduce(tensors, "adasum", comm, False, inplace=True, shard=shard)


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


def _allreduce(tensors, op, comm, hierarchical: bool, inplace: bool, companion: Companion | None = None,
               shard: MPI.Intracomm | None = None):
    what = "adasum_allreduce_inplace" if inplace else "adasum_allreduce"
    with context_for(comm).call(what, companion=companion, shard=shard) as call:
        use_isa(call.settings.kernels_isa)
        extras = agreed_extras(call)
        if call.ctx.size > 1:
            done = _round_trip(call, extras, tensors, op, hierarchical, inplace)
            if done is not None:
                return done
        return _on_host(call, extras, tensors, op, hierarchical, inplace)


def _round_trip(call: Call, extras: dict, tensors, op, hierarchical: bool, inplace: bool):
    """Staged device tensors through one host round trip (:mod:`adasum.call.roundtrip`), or None."""
    first = tensors[0] if type(tensors) in (list, tuple) and tensors else tensors
    if type(first) is np.ndarray or getattr(first, "is_cuda", None) is False:
        return None  # host tensors (the common case, checked in a fraction of a microsecond)
    if type(tensors) in (list, tuple):
        single, items = False, list(tensors)
    elif array_kind(tensors) in ("torch", "cupy"):
        single, items = True, [tensors]
    else:
        return None
    done = round_trip(call, items, inplace, lambda c, host: _on_host(c, extras, host, op, hierarchical, True))
    if done is None:
        return None
    return done[0] if single else (tensors if inplace and type(tensors) is list else list(done))


def _on_host(call: Call, extras: dict, tensors, op, hierarchical: bool, inplace: bool):
    """The call on tensors that MPI takes as they are (host memory, or device memory for a CUDA-aware MPI),
    or that the general path stages."""
    known = None
    if type(op) in (str, Op) and op in _PLAIN_OPS and not hierarchical and call.ctx.size > 1:
        done = _plain(call, extras, tensors, op, inplace)
        if done is not _NOT_TAKEN:
            return done
    if op == "adasum" and not hierarchical and type(tensors) is list and call.ctx.size > 1 \
            and call.shard is None and small_call.allowed(call.settings):
        known = kept_plan(call.ctx, tensors, extras["adasum"])
        if known is not None and known.small is not None:
            done = small_call.run_small(call, known, tensors, inplace, extras)
            if done is not None:
                return done
    return _general(call, extras, tensors, op, hierarchical, inplace, known)


_PLAIN_OPS = frozenset(("sum", "mean"))  # Op.SUM and Op.MEAN hash and compare as these strings
_NOT_TAKEN = object()


def _plain(call: Call, extras: dict, tensors, op, inplace: bool):
    """``sum`` and ``mean`` of host tensors where they lie (:mod:`adasum.call.plain`), or ``_NOT_TAKEN``
    (before any communication) for the general path, which also describes whatever is wrong."""
    check_launch()
    op = op.value if type(op) is Op else op  # one of _PLAIN_OPS: the enum call costs a microsecond
    try:
        single, items = (False, tensors) if type(tensors) is list else _as_list(tensors)
        # a sparse torch tensor may find the plan of dense ones here: both paths below refuse it
        plan, key = plan_for(call, items, op, extras[op], dense=False)
    except Exception:
        return _NOT_TAKEN
    small = plan.small
    out = None
    if small is not None and small_call.allowed(call.settings):  # the compiled small plain call
        out = small(call, items, single, inplace, extras["patience"])
    if out is None:
        out = run_plain(call, plan, items, single, inplace, op, extras[op])
    if out is None:
        return _NOT_TAKEN
    if key is not None:
        call.ctx.keep(key, plan)
    return out


class _State:
    """One call's own state on the general path: its tensors, its plan and, per group, the operand (the
    placement and buffers of :func:`adasum.call.plan.place`) and the caller's tensors of that group."""

    __slots__ = ("single", "items", "op", "plan", "key", "operands", "members")

    def __init__(self, op: str):
        self.single, self.items, self.op = False, [], op
        self.plan: Plan | None = None
        self.key = None  # a new plan's key: kept once the call succeeded
        self.operands: list[Operand] = []
        self.members: list[list] = []


def _general(call: Call, extras: dict, tensors, op, hierarchical: bool, inplace: bool, known: Plan | None):
    """Every call that the compiled small call (:mod:`adasum.schedules.small_call`) does not take. ``known``: the call's plan, where it was found."""
    check_launch()  # a job whose processes MPI does not see raises here, on the first call
    ctx, s = call.ctx, call.settings
    state, error = _State(str(op)), None
    extra = (("hierarchical", bool(hierarchical)),)
    try:
        extra = _prepare(call, extras, state, tensors, op, hierarchical, inplace, known)
    except Exception as exc:  # whatever this rank cannot take, every rank raises (after the agreement)
        error = exc if str(exc).startswith("rank ") else _on_rank(exc, ctx.rank)
        state.operands, state.members = [], []
    plan = state.plan if error is None else None
    # Halves sent straight from the caller's tensors go as one message per large layer piece (MPI's
    # fast path needs a contiguous send buffer): every rank must then cut its messages the same way.
    split = agree(call, state.op, None if plan is None else plan.descs, error, extra=extra,
                  digest=None if plan is None else plan.signature,
                  vote=FUSED_VOTE if state.op in ("sum", "mean") else
                  int(plan is not None and plan.nbytes >= s.split_min_bytes
                      and any(g.placement in (Placement.READS_PARTS, Placement.IN_PARTS) for g in state.operands)))
    active = [g for g in state.operands if g.size > 0]
    if active:
        _SCHEDULES[plan.schedule](call, plan, active, s.chunk_bytes if split else 0)
    out = _finish(ctx, state, tensors, inplace)
    if state.key is not None:
        ctx.keep(state.key, plan)
    return out


def _prepare(call: Call, extras: dict, state: _State, tensors, op, hierarchical: bool, inplace: bool,
             known: Plan | None) -> tuple:
    """This rank's part of the call before the agreement: parse, plan, place and pack (so that anything
    this rank cannot do is known before any data moves). Returns what the ranks agree on besides the
    tensors."""
    ctx, s = call.ctx, call.settings
    state.single, state.items = _as_list(tensors)
    state.op = _parse_op(op)
    if hierarchical and state.op != "adasum":
        raise ValueError(f"hierarchical=True needs op 'adasum', got '{state.op}'")
    extra = extras["hierarchical" if hierarchical else "sharded" if call.shard is not None else state.op]
    if known is not None:
        plan = state.plan = known
    else:
        plan, state.key = plan_for(call, state.items, state.op, extra)
        state.plan = plan
    items = state.items
    members = [items] if plan.one_group else [[items[i] for i in g.indices] for g in plan.groups]
    # where the tensors lie decides how the result gets into them; read-only ones fail here
    layouts = [_layout(g.adapter.layout(mine, g.indices, ctx.rank)) for g, mine in zip(plan.groups, members)] \
        if inplace else None
    operands = []
    for g, mine, (placement, aliased, parts) in zip(plan.groups, members, place(plan, members, layouts, inplace, s)):
        buffer = aliased
        if placement not in (Placement.ALIASED, Placement.IN_PARTS):
            if inplace:
                buffer = ctx.buffers.get(g.adapter.kind, g.device, g.dtype, g.size, "fused")
            else:
                buffer = g.adapter.empty(g.size, g.dtype, g.device)
            if placement.packs:
                g.adapter.pack(mine, buffer, g.bounds, g.spans)
                call.record("copied_bytes", g.size * itemsize(g.dtype))
        operands.append(Operand(g, buffer, placement, parts))
    state.operands, state.members = operands, members
    return extra


def _finish(ctx: Context, state: _State, tensors, inplace: bool):
    """Write the result into the caller's tensors (in place) or return views of it."""
    if inplace:
        for g, mine in zip(state.operands, state.members):
            if g.writes_parts or (g.placement is Placement.ALIASED and ctx.size > 1):
                g.adapter.wrote_parts(mine)  # written through other views of their memory
            elif g.size > 0 and g.placement is not Placement.ALIASED:
                g.adapter.write_back(mine, g.buffer, g.bounds, g.spans)
                if ctx.counters:
                    ctx.record("copied_bytes", g.size * itemsize(g.dtype))
        return tensors
    out: list[Any] = [None] * len(state.items)
    for g in state.operands:
        for i, view in zip(g.indices, g.adapter.views(g.buffer, g.bounds, g.shapes)):
            out[i] = view
    return out[0] if state.single else out


def _on_rank(exc: Exception, rank: int) -> Exception:
    """``exc`` with its text starting with the rank that raised it."""
    try:
        return type(exc)(f"rank {rank}: {exc}")
    except Exception:  # an exception type that takes other arguments
        return RuntimeError(f"rank {rank}: {type(exc).__name__}: {exc}")


def _layout(where: int | None) -> TensorLayout | None:
    return None if where is None else TensorLayout(where)


_OP_NAMES = frozenset(o.value for o in Op)


def _halving(call: Call, plan: Plan, operands: Sequence[Operand], split: int) -> None:
    adasum_reduce(call, call.lcomm, operands, plan.transports(call, operands), split=split,
                  local_sum=None if call.shard is None else partials_summed_over(call, call.shard))


def _doubling(call: Call, plan: Plan, operands: Sequence[Operand], split: int) -> None:
    adasum_reduce_doubling(call, call.lcomm, operands, plan.transports(call, operands))


def _hierarchical(call: Call, plan: Plan, operands: Sequence[Operand], split: int) -> None:
    hierarchical_reduce(call, operands)


def _plain_reduce(call: Call, groups: Sequence[Operand], mean: bool) -> None:
    """``sum`` and ``mean``: MPI's allreduce on each fused buffer; 16-bit floats travel as 16 bits, summed
    in float32 (:meth:`~adasum.runtime.collectives.Collectives.allreduce_16bit`)."""
    size = call.ctx.size
    for g in groups:
        t = Collectives(call, transport_for(call, call.lcomm, g.adapter, g.device, g.buffer))
        if g.dtype in ("float16", "bfloat16"):
            t.allreduce_16bit(g.buffer, g.dtype, mean)
        else:
            t.allreduce_sum(g.buffer)
            if mean:
                g.adapter.divide(g.buffer, size)


# The schedules, each run the same way: (the call, plan, the operands with data, the agreed message split).
_SCHEDULES = {
    Schedule.NONE: lambda call, plan, operands, split: None,
    Schedule.DOUBLING: _doubling,
    Schedule.HALVING: _halving,
    Schedule.HIERARCHICAL: _hierarchical,
    Schedule.SUM: lambda call, plan, operands, split: _plain_reduce(call, operands, mean=False),
    Schedule.MEAN: lambda call, plan, operands, split: _plain_reduce(call, operands, mean=True),
}
