"""Planning a call: what its tensors and settings determine, worked out before any data moves.

A :class:`Plan` is what the shapes, dtypes, devices, the op and the agreed settings of a call determine:
the descriptions the ranks agree on, the groups and their layer tables, and the :class:`Schedule`, chosen
once. Plans are kept in the communicator's context for calls of the same shapes (a training loop's every
step), once such a call succeeded on every rank, and hold no buffers. :func:`place` then decides, for one call, where each group's data lies while it
is reduced (its :class:`~adasum.schedules.fusion.Placement`).
"""

from __future__ import annotations

import enum
from typing import Any, Sequence

from ..runtime import stall
from ..runtime.agreement import describe, signature
from ..schedules.small_call import small_call_for
from .small_plain import small_plain_for
from ..rule.dtypes import itemsize
from ..schedules.fusion import Group, Operand, Placement, TensorLayout, layer_spans, make_groups
from ..kernels.native import compiled
from ..kernels import segmented
from ..settings import Settings, triton_interpreted
from ..runtime.transport import Transport, transport_for

__all__ = ["Plan", "Schedule", "agreed_extras", "kept", "kept_plan", "place", "plan_for", "plan_key"]


class Schedule(enum.Enum):
    """How a call's data travels and is combined: one per plan, chosen by :func:`choose`."""

    NONE = "none"                  # one rank: nothing to exchange
    DOUBLING = "doubling"          # whole vectors, log2 P rounds (adasum.schedules.doubling; the compiled small call)
    HALVING = "halving"            # recursive halving, about 2·N bytes per rank (adasum.schedules.halving)
    HIERARCHICAL = "hierarchical"  # the mean inside each node, then halving over the nodes
    SUM = "sum"                    # MPI's own allreduce
    MEAN = "mean"                  # MPI's own allreduce, divided by P


def choose(op: str, hierarchical: bool, size: int, nbytes: int, s: Settings, across_hosts: bool = False,
           sharded: bool = False) -> Schedule:
    """The schedule of a call of ``nbytes`` over ``size`` ranks under the settings ``s``. Across hosts
    (``across_hosts``) and under the automatic threshold, doubling is taken only where it puts no more
    bytes on a link than halving: after the fold to 2^k ranks, doubling sends k·N bytes per rank and
    halving 2·N·(2^k - 1)/2^k, so only for 2^k = 2. A set ``small_message_bytes`` overrides this.
    ``sharded`` (layers cut across another group of ranks): halving, whose partial dot products the other
    group's ranks add to theirs."""
    if size == 1:
        return Schedule.NONE
    if op != "adasum":
        return Schedule(op)
    if hierarchical:
        return Schedule.HIERARCHICAL
    if sharded:
        return Schedule.HALVING
    if across_hosts and s.small_message_bytes is None and size.bit_length() - 1 > 1:
        return Schedule.HALVING
    return Schedule.HALVING if nbytes > s.small_message_limit(size) else Schedule.DOUBLING


def agreed_extras(call) -> dict:
    """What the ranks must agree on besides the tensors, per kind of call (part of the digest), for the
    settings of ``call``; kept on the context while the settings stay the same."""
    ctx, s = call.ctx, call.settings
    kept = ctx.extras
    if kept is None or kept[0] is not s:
        # the host kernels' back end is agreed too: the compiled and the numpy kernels round differently
        agreed = (*s.agreed(), ("host kernels", int(compiled is not None and s.kernels == "c")))
        plain = (("hierarchical", False), ("plain direct bytes", s.plain_direct_bytes))
        extras = {"adasum": (("hierarchical", False), *agreed), "hierarchical": (("hierarchical", True), *agreed),
                  "sharded": (("hierarchical", False), ("sharded", 1), *agreed),
                  "sum": plain, "mean": plain,
                  # and what these settings make of this communicator's calls
                  "patience": stall.patience(s, ctx)}
        kept = ctx.extras = (s, extras)
    return kept[1]


class Plan:
    """What a call's tensors and agreed settings determine: descriptions, the agreement signature, the
    groups with their layer tables, the schedule, and the compiled small call where it may run
    (:class:`~adasum.schedules.small_call.SmallCall` for Adasum, :class:`~adasum.call.small_plain.SmallPlain`
    for sum and mean). Kept in the
    communicator's context; holds no buffers (what one call holds lives in its operands)."""

    __slots__ = ("descs", "signature", "nbytes", "one_group", "groups", "schedule", "small", "torch",
                 "_transports")

    def __init__(self, call, items, op: str, extra: tuple):
        ctx, s = call.ctx, call.settings
        adapters, self.descs = describe(items, op, ctx.rank, ctx.adapters)
        self.signature = signature(op, self.descs, extra)
        self.groups: list[Group] = make_groups(items, adapters, self.descs)
        if op == "adasum" and s.device_kernels == "triton":
            _check_triton(self.groups, ctx.rank)
        self.torch = any(g.adapter.kind == "torch" for g in self.groups)  # whose tensors have layouts
        for g in self.groups:
            layer_spans(g)
        self.nbytes = sum(g.size * itemsize(g.dtype) for g in self.groups)
        # one group holding every tensor in order: the call's list is the group's members
        self.one_group = len(self.groups) == 1 and self.groups[0].indices == list(range(len(items)))
        # the agreed settings are part of the plan's key, so the schedule is the plan's
        self.schedule = choose(op, dict(extra)["hierarchical"], ctx.size, self.nbytes, s, ctx.across_hosts,
                               bool(dict(extra).get("sharded")))
        # the compiled small call (Adasum) or small plain call (sum, mean), where the plan's calls may take it
        self.small = small_call_for(call, self.schedule is Schedule.DOUBLING, self.one_group, self.groups,
                                    len(items)) or \
            small_plain_for(call, op if self.schedule in (Schedule.SUM, Schedule.MEAN) else None, self.one_group,
                            self.groups, len(items), self.descs, self.signature, extra)
        self._transports: tuple = (None, [])

    def transports(self, call, operands: Sequence[Operand]) -> list[Transport]:
        """One :class:`Transport` per operand on the library's communicator, kept while the settings and
        the waiting mode stay the same (whether a group is staged depends on those and on its device only)."""
        key = (call.settings, call.waiting)
        kept_key, out = self._transports
        if kept_key is not None and kept_key[0] is key[0] and kept_key[1] == key[1] and len(out) == len(operands):
            return out
        out = [transport_for(call, call.lcomm, g.adapter, g.device, g.buffer) for g in operands]
        self._transports = (key, out)
        return out


def _check_triton(groups: Sequence[Group], rank: int) -> None:
    """Refuse, before any data moves, what the forced Triton kernels (``device_kernels="triton"``) cannot
    run: triton missing, or torch/cupy buffers in host memory without triton's interpreter."""
    for g in groups:
        if g.adapter.kind == "numpy":
            continue  # numpy arrays always take the host kernels
        if not segmented.available():
            raise ImportError(f"rank {rank}: the setting device_kernels='triton' needs torch and triton to be "
                              "installed; use device_kernels='auto' or 'per-layer'")
        if g.device == "cpu" and not triton_interpreted():
            raise TypeError(f"rank {rank}: tensor {g.indices[0]} is a CPU tensor, and the setting "
                            "device_kernels='triton' runs Triton kernels, which take CUDA tensors only (CPU "
                            "tensors only under triton's interpreter, TRITON_INTERPRET=1); use "
                            "device_kernels='auto' or 'per-layer' for CPU tensors")


def plan_key(items, op: str, extra: tuple) -> tuple:
    """What a call's plan depends on besides the tensors' layouts: the op, the agreed settings and, per
    tensor, its type, shape, dtype and device. Plans are kept only for calls that succeeded, so only for
    dense tensors: :func:`kept` looks one up for tensors that are all dense (a sparse torch tensor of a dense
    one's shape has the same key and no plan)."""
    if compiled is not None:
        return op, extra, compiled.key(items)
    return op, extra, tuple([(type(t), t.shape, t.dtype, getattr(t, "device", None)) for t in items])


def kept_plan(ctx, items, extra: tuple) -> "Plan | None":
    """The plan kept for an Adasum call of ``items`` with ``extra``, or None (also where ``items`` have no
    key: the general path describes what is wrong with them)."""
    try:
        return kept(ctx, plan_key(items, "adasum", extra), items)  # hashing the key may raise (cupy's device)
    except (AttributeError, TypeError, RuntimeError):
        return None


def kept(ctx, key, items, dense: bool = True) -> "Plan | None":
    """The plan kept under ``key`` for ``items``, or None (also where a torch tensor among them is not
    dense: the plan was made for dense ones; ``dense=False`` leaves that check to a caller that refuses such
    tensors itself)."""
    last = ctx.last_plan
    if last[0] == key:  # the previous call's shapes again: no hashing
        plan = last[1]
    else:
        plan = ctx.plans.get(key)
        if plan is not None:
            ctx.last_plan = (key, plan)
    if dense and plan is not None and plan.torch and not _dense(items):
        return None
    return plan


def _dense(items) -> bool:
    import torch  # loaded: the plan holds torch tensors

    tensor, strided = torch.Tensor, torch.strided
    for t in items:
        if isinstance(t, tensor) and t.layout is not strided:
            return False
    return True


def plan_for(call, items, op: str, extra: tuple, dense: bool = True) -> tuple[Plan, tuple | None]:
    """The kept plan of this call and None, or a new plan and the key to keep it under once the call
    succeeded (:meth:`Context.keep`; None where the call has no key). ``dense``: as for :func:`kept`."""
    try:
        key = plan_key(items, op, extra)
        plan = kept(call.ctx, key, items, dense)  # hashes the key: a TypeError where a device does not hash
    except TypeError:
        try:
            key = _spelled_key(items, op, extra)
            plan = kept(call.ctx, key, items)
        except (AttributeError, TypeError, RuntimeError):  # not an array, or without a shape (a nested
            return Plan(call, items, op, extra), None  # tensor): describe() says what is wrong
    except (AttributeError, RuntimeError):
        return Plan(call, items, op, extra), None
    if plan is not None:
        return plan, None
    return Plan(call, items, op, extra), key


def _spelled_key(items, op: str, extra: tuple) -> tuple:
    """:func:`plan_key` with each device given by its type and text: a cupy device defines equality but no
    hash, and its text names its id."""
    out = []
    for t in items:
        device = getattr(t, "device", None)
        out.append((type(t), t.shape, t.dtype, type(device), str(device)))
    return op, extra, tuple(out)


def place(plan: Plan, members: Sequence[list], layouts: Sequence[TensorLayout | None] | None, inplace: bool,
          s: Settings) -> list[tuple[Placement, Any, Any]]:
    """Where each group's data lies while this call reduces it: ``(placement, aliased buffer or None,
    parts or None)`` per group of ``plan``. ``members``: each group's tensors; ``layouts``: where they lie
    (in-place calls only). Flat Adasum may use the caller's tensors directly: an in-place call on tensors
    that lie apart is combined in them, so that nothing is written back at the end (doubling at any size,
    halving from ``direct_min_bytes``, where it also reads them without packing them first)."""
    if inplace and plan.schedule is Schedule.NONE:  # one rank, in place: the tensors hold the result already
        return [(Placement.IN_PARTS, None, None) for _ in plan.groups]
    halving = plan.schedule is Schedule.HALVING
    direct = plan.schedule in (Schedule.DOUBLING, Schedule.HALVING) and s.gpu_transport != "staged" \
        and (not halving or plan.nbytes >= s.direct_min_bytes)
    out = []
    for i, (g, mine) in enumerate(zip(plan.groups, members)):
        where = layouts[i] if inplace else None
        if inplace and where in (TensorLayout.ADJACENT, None):
            view = g.adapter.fused_view(mine, adjacent=where == TensorLayout.ADJACENT)
            if view is not None and len(view) == g.size:
                out.append((Placement.ALIASED, view, None))
                continue
        parts = None
        # out of place, doubling reads packed buffers only
        if direct and g.size > 0 and (halving or inplace) and (not inplace or where in (TensorLayout.APART,
                                                                                          TensorLayout.ADJACENT)):
            parts = g.adapter.direct_parts(mine, g.dtype, contiguous=where is not None, s=s)
        if parts is None:
            out.append((Placement.PACKED, None, None))
        elif inplace:
            out.append((Placement.IN_PARTS if halving else Placement.WRITES_PARTS, None, parts))
        else:
            out.append((Placement.READS_PARTS, None, parts))
    return out
